"""The engine step: schedule -> execute -> update."""

from tierserve.engine.engine import Engine
from tierserve.engine.lifecycle import RequestOutput
from tierserve.engine.scheduler import Scheduler, SchedulerOutput
from tierserve.engine.stats import EngineStats
from tierserve.scheduling.step import PreemptMode

__all__ = ["Engine", "EngineStats", "PreemptMode", "RequestOutput", "Scheduler", "SchedulerOutput"]
