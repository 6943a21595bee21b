"""asyncrl: an asyncio single controller with futures pipelining for RL post-training."""

from asyncrl._tensordict_import import import_tensordict

import_tensordict()  # first: without torch._dynamo (asyncrl/_tensordict_import.py says why)

from asyncrl.dispatch import Broadcast, MeshRank, World
from asyncrl.errors import (
    AsyncRLError,
    CallCancelledError,
    CallTimeoutError,
    DispatchError,
    GroupBrokenError,
    GroupClosedError,
    LaneWedgedError,
    PlacementError,
    RegistrationError,
    RemoteError,
    UpstreamError,
    WorkerDiedError,
)
from asyncrl.future import GroupFuture, gather
from asyncrl.register import (
    Dispatch,
    DispatchMode,
    Execute,
    Mode,
    get_dispatch_mode,
    register,
    register_dispatch_mode,
)
from asyncrl.resources import ResourcePool
from asyncrl.runtime import ainit, ashutdown, init, run, shutdown
from asyncrl.worker import Worker, WorkerContext
from asyncrl.worker_group import (
    Colocated,
    GroupMethod,
    GroupStats,
    LocalWorkerGroup,
    RayWorkerGroup,
    WorkerGroup,
    colocate,
)

__all__ = [
    "ainit",
    "ashutdown",
    "AsyncRLError",
    "Broadcast",
    "CallCancelledError",
    "CallTimeoutError",
    "Colocated",
    "Dispatch",
    "DispatchError",
    "DispatchMode",
    "Execute",
    "GroupBrokenError",
    "GroupClosedError",
    "GroupFuture",
    "GroupMethod",
    "GroupStats",
    "LaneWedgedError",
    "LocalWorkerGroup",
    "MeshRank",
    "Mode",
    "PlacementError",
    "RayWorkerGroup",
    "RegistrationError",
    "RemoteError",
    "ResourcePool",
    "UpstreamError",
    "Worker",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerGroup",
    "World",
    "colocate",
    "gather",
    "get_dispatch_mode",
    "init",
    "register",
    "register_dispatch_mode",
    "run",
    "shutdown",
]

__version__ = "0.1.0"
