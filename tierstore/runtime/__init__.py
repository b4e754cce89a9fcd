"""The tiered runtime: a device expert pool over the host arena over a pack, the step protocol
with fixed-point replay, and the transformers integration (`tierstore.runtime.hf`).

Importing this package loads torch and `tierstore.kernels` (and so triton where it is installed);
transformers loads only with `tierstore.runtime.hf`. `import tierstore` loads none of this.
"""

from tierstore.runtime.config import REPLAY_MODES, RuntimeConfig
from tierstore.runtime.engine import TieredRuntime, check_working_set, slots_for, working_set_slots
from tierstore.runtime.passlog import PassReport
from tierstore.runtime.pools import DevicePool
from tierstore.runtime.rows import MemoryRowSource
from tierstore.runtime.stats import RuntimeStats
from tierstore.runtime.step import ReplayLimitError, StepOutcome

__all__ = ["DevicePool", "MemoryRowSource", "PassReport", "REPLAY_MODES", "ReplayLimitError", "RuntimeConfig",
           "RuntimeStats", "StepOutcome", "TieredRuntime", "check_working_set", "slots_for", "working_set_slots"]
