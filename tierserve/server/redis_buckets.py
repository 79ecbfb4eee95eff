"""Token buckets in Redis, shared by every server replica (docs/design.md §8).

Each operation is one Lua script, so it is atomic, and it reads the Redis server's
clock (`TIME`), so replicas with skewed clocks agree. A bucket is a hash
``{level, ts}`` that expires once it would have refilled anyway. A bucket's key that holds
something else (written by another program under the prefix) starts over as a full bucket:
its WRONGTYPE error had read as Redis being down, for every tenant, at each request. The
expiry is capped at MAX_TTL_S (about 32 years): a bucket that refills more slowly (a burst
of 1e19 tokens, a rate of 1e-13 per second) asked for one Redis refuses, and that error,
too, read as Redis being down.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tierserve.server.buckets import Bucket, BucketLevel, TakeResult

# KEYS[i]: bucket i. ARGV: rate_1, capacity_1, cost_1, rate_2, ...
# Returns {allowed (0/1), level_1, wait_1, level_2, wait_2, ...}; numbers as strings, because
# Redis truncates Lua numbers to integers in replies.
TAKE_SCRIPT = """
local MAX_TTL_S = 1000000000
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = #KEYS
local levels = {}
local allowed = 1
for i = 1, n do
  local rate = tonumber(ARGV[3 * i - 2])
  local cap = tonumber(ARGV[3 * i - 1])
  local cost = tonumber(ARGV[3 * i])
  if redis.call('TYPE', KEYS[i]).ok ~= 'hash' then redis.call('DEL', KEYS[i]) end
  local v = redis.call('HMGET', KEYS[i], 'level', 'ts')
  local level = tonumber(v[1])
  local ts = tonumber(v[2])
  if level == nil or ts == nil then
    level = cap
    ts = now
  end
  level = math.min(cap, level + math.max(0, now - ts) * rate)
  levels[i] = level
  if level < cost then allowed = 0 end
end
local out = {allowed}
for i = 1, n do
  local rate = tonumber(ARGV[3 * i - 2])
  local cap = tonumber(ARGV[3 * i - 1])
  local cost = tonumber(ARGV[3 * i])
  local level = levels[i]
  local wait = 0
  if level < cost then wait = (cost - level) / rate end
  if allowed == 1 then level = level - cost end
  redis.call('HSET', KEYS[i], 'level', tostring(level), 'ts', tostring(now))
  redis.call('EXPIRE', KEYS[i], math.min(math.ceil((cap - math.min(level, 0)) / rate) + 60, MAX_TTL_S))
  out[#out + 1] = tostring(level)
  out[#out + 1] = tostring(wait)
end
return out
"""

# KEYS[1]: the bucket. ARGV: rate, capacity, amount. Refill (capped at capacity), then add
# the amount (a debt when negative: what a request used past its reservation), capped again.
# Capping the refill and the amount together forgave such a debt when the bucket had
# refilled past full while the request ran (the in-process backend, `give_now`, charged it).
GIVE_SCRIPT = """
local MAX_TTL_S = 1000000000
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate = tonumber(ARGV[1])
local cap = tonumber(ARGV[2])
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then redis.call('DEL', KEYS[1]) end
local v = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level = tonumber(v[1])
local ts = tonumber(v[2])
if level == nil or ts == nil then
  level = cap
  ts = now
end
level = math.min(cap, math.min(cap, level + math.max(0, now - ts) * rate) + tonumber(ARGV[3]))
redis.call('HSET', KEYS[1], 'level', tostring(level), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], math.min(math.ceil((cap - math.min(level, 0)) / rate) + 60, MAX_TTL_S))
return tostring(level)
"""


MAX_CONNECTIONS = 64  # to Redis, per process: a command takes well under a millisecond
# How long a command waits for a pooled connection: 4 x redis_timeout_s, at least 0.5 s (a
# burst of 400 on a fresh pool, its connections still opening, found none within one
# timeout of 50 ms, and fail-closed tiers refused a quarter of it on a healthy Redis; a
# hung Redis is found down by its commands' own timeouts meanwhile).
POOL_WAIT_TIMEOUTS = 4
MIN_POOL_WAIT_S = 0.5


class RedisBuckets:
    """`BucketBackend` on a Redis server. Raises `redis.RedisError` (or OSError) when unreachable."""

    def __init__(self, url: str, *, timeout_s: float, key_prefix: str) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError

        # One immediate retry of a broken connection (on a fresh one: a pooled one may be
        # stale after Redis restarts), then fail fast: redis-py's default of 10 retries with
        # backoff would hold each decision for seconds while Redis is away, instead of
        # applying the fail rule. Not of a timeout: the take is not idempotent, and a slow
        # Redis ran it twice, charging twice a request it then refused. A connection that
        # breaks after Redis ran the script but before its reply came is retried too, and
        # charges twice: rare, and the price of getting past a pooled connection gone stale.
        #
        # Connections from a bounded pool that a burst waits on: redis-py's default pool
        # refuses the 101st concurrent command (MaxConnectionsError, a ConnectionError), and
        # a burst of 200 requests found a healthy Redis "unreachable": fail-closed tiers
        # got 503s, fail-open ones the local share. A waiter gives up after the wait above
        # (then Redis is taken for down, as a timeout says).
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=max(POOL_WAIT_TIMEOUTS * timeout_s, MIN_POOL_WAIT_S),
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        self._client: Any = aioredis.Redis(connection_pool=pool)
        self._prefix = key_prefix
        self._take = self._client.register_script(TAKE_SCRIPT)
        self._give = self._client.register_script(GIVE_SCRIPT)

    def _key(self, bucket: Bucket) -> str:
        return f"{self._prefix}:bucket:{bucket.key}"

    async def take(self, buckets: Sequence[Bucket], costs: Sequence[float]) -> TakeResult:
        args: list[str] = []
        for bucket, cost in zip(buckets, costs, strict=True):
            args += [repr(bucket.rate_per_s), repr(bucket.capacity), repr(float(cost))]
        reply = await self._take(keys=[self._key(b) for b in buckets], args=args)
        allowed = int(reply[0]) == 1
        levels = tuple(
            BucketLevel(remaining=float(reply[1 + 2 * i]), wait_s=float(reply[2 + 2 * i]))
            for i in range(len(buckets))
        )
        return TakeResult(allowed=allowed, levels=levels)

    async def give(self, bucket: Bucket, amount: float) -> None:
        await self._give(
            keys=[self._key(bucket)],
            args=[repr(bucket.rate_per_s), repr(bucket.capacity), repr(float(amount))],
        )

    async def ping(self) -> bool:
        return bool(await self._client.ping())

    async def close(self) -> None:
        await self._client.aclose()
