"""The engine step: schedule -> execute -> update."""

from tierserve.engine.engine import Engine, RequestOutput
from tierserve.engine.scheduler import PreemptMode, Scheduler, SchedulerOutput
from tierserve.engine.stats import EngineStats

__all__ = ["Engine", "EngineStats", "PreemptMode", "RequestOutput", "Scheduler", "SchedulerOutput"]
