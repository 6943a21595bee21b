"""Where a role computes and in what precision: device selection, dtypes, autocast, GPU memory.

Every role that holds a model resolves its :class:`Placement` once, in its constructor
(so a bad setting fails at setup, before training starts), from three
:class:`~asyncrl.roles.ModelConfig` fields::

    device    "auto"  -> the worker's GPU when its bundle reserves one (ResourcePool(gpus_per_bundle>0)), else CPU
              "cpu" | "cuda" | "cuda:N"  -> exactly that; "cuda" without a visible GPU is a DeviceError
    dtype     "auto"  -> CPU: float32 everywhere
                         GPU: float32 master weights + bf16 autocast for trained roles (policy, critic),
                              bfloat16 weights for frozen ones (rollout, reference, reward model)
              "float32" | "bfloat16" | "float16" -> the parameters of every role in that dtype
    autocast  "auto"  -> bf16 only where dtype="auto" picked float32 master weights on a GPU
              "off" | "bfloat16" | "float16" -> exactly that

Log-softmax, entropies, advantages and losses are computed in float32 whatever the
parameter or autocast dtype (the logits are upcast first). bf16 on a CPU without native
bf16 instructions, and bf16 on a GPU that lacks it (pre-Ampere), are DeviceErrors that
say what to set instead.

"auto" asks where the *bundle* has a GPU, not the machine: a worker constructed outside a
group, or placed on a CPU-only pool, computes on the CPU even on a GPU machine.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from asyncrl.roles.errors import DeviceError

__all__ = [
    "Placement",
    "resolve_device",
    "resolve_precision",
    "resolve_placement",
    "cpu_supports_bf16",
    "cuda_supports_bf16",
    "estimate_model_bytes",
    "check_gpu_memory",
    "device_uuid",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEVICE_CHOICES = "'auto', 'cpu', 'cuda' or 'cuda:N'"


@dataclass(frozen=True)
class Placement:
    """A role's resolved device and precision."""

    device: torch.device
    """Where the role's model and its compute live."""
    param_dtype: torch.dtype
    """Dtype of the model's parameters."""
    autocast_dtype: torch.dtype | None
    """Dtype of the forward pass under ``torch.autocast`` (None: no autocast)."""

    @property
    def is_cuda(self) -> bool:
        """True on a GPU."""
        return self.device.type == "cuda"

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """``torch.autocast`` on the role's device when mixed precision is on; else nothing."""
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype):
            yield

    def describe(self) -> dict[str, str]:
        """``{"device", "param_dtype", "autocast"}`` as strings (logs, metrics, tests)."""
        return {"device": str(self.device), "param_dtype": _name(self.param_dtype),
                "autocast": _name(self.autocast_dtype) if self.autocast_dtype is not None else "off"}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_supports_bf16() -> bool:
    """Whether this CPU has native bf16 support (what PyTorch's oneDNN bf16 kernels need)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # no oneDNN in this build (e.g. some ARM wheels)
        return False


def cuda_supports_bf16(device: torch.device | None = None) -> bool:
    """Whether the GPU computes in bf16 natively (compute capability >= 8.0)."""
    if not torch.cuda.is_available():
        return False
    idx = device.index if device is not None and device.index is not None else 0
    return torch.cuda.get_device_capability(idx) >= (8, 0)


def resolve_device(spec: str, *, bundle_gpus: float, cuda_count: int | None = None, who: str = "the role") -> torch.device:
    """The device `spec` means for a worker whose bundle reserves `bundle_gpus` GPUs.

    `cuda_count` is the number of GPUs torch sees in this process (None: ask torch). Raises
    :class:`DeviceError` for ``cuda`` without a visible GPU, an index past the visible ones,
    a bundle that reserves a GPU torch cannot see, or an unknown spelling.
    """
    if not isinstance(spec, str):
        raise DeviceError(f"{who}: device must be {_DEVICE_CHOICES}, got {spec!r}")
    n = torch.cuda.device_count() if cuda_count is None else cuda_count
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"
    build = f"torch {torch.__version__}" + ("" if torch.version.cuda else " (a CPU-only build)")
    s = spec.strip().lower()
    if s == "cpu":
        return torch.device("cpu")
    if s == "auto":
        if bundle_gpus > 0:
            if n == 0:
                raise DeviceError(
                    f"{who}: device='auto' and the worker's bundle reserves {bundle_gpus:g} GPU, but torch sees no "
                    f"GPU in this process ({build}, {seen}); install a CUDA build of torch on the GPU nodes, or "
                    "place the role on a CPU pool (gpus_per_bundle=0) / set device='cpu'"
                )
            return torch.device("cuda", 0)  # Ray exposes the bundle's GPU(s) as the first visible ones
        return torch.device("cpu")
    if s == "cuda" or s.startswith("cuda:"):
        idx = 0
        if s != "cuda":
            try:
                idx = int(s.split(":", 1)[1])
            except ValueError:
                raise DeviceError(f"{who}: device must be {_DEVICE_CHOICES}, got {spec!r}") from None
        if n == 0:
            hint = ("the worker's bundle reserves no GPU: give its pool GPUs (ResourcePool(..., gpus_per_bundle=1) "
                    "or trainer.gpus_per_worker), or " if bundle_gpus <= 0 else "")
            raise DeviceError(
                f"{who}: device={spec!r} but torch sees no GPU in this process ({build}, {seen}); "
                f"{hint}set device='cpu' (or 'auto', which uses a GPU only when the bundle has one)"
            )
        if idx >= n:
            raise DeviceError(f"{who}: device={spec!r} but this process sees {n} GPU(s) ({seen}); use cuda:0..cuda:{n - 1}")
        return torch.device("cuda", idx)
    raise DeviceError(f"{who}: device must be {_DEVICE_CHOICES}, got {spec!r}")


def resolve_precision(dtype: str, autocast: str, device: torch.device, *, trained: bool,
                      bf16_supported: bool, who: str = "the role") -> tuple[torch.dtype, torch.dtype | None]:
    """``(parameter dtype, autocast dtype or None)`` for a role on `device` (see the module table).

    `bf16_supported` says whether `device` computes in bf16 (:func:`cpu_supports_bf16` /
    :func:`cuda_supports_bf16`); asking for bf16 where it is False raises :class:`DeviceError`.
    """
    on_gpu = device.type == "cuda"
    if dtype == "auto":
        if on_gpu and bf16_supported:
            param = torch.float32 if trained else torch.bfloat16
        else:
            param = torch.float32
    elif dtype in _DTYPES:
        param = _DTYPES[dtype]
    else:
        raise DeviceError(f"{who}: dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    if autocast == "auto":
        amp = torch.bfloat16 if (dtype == "auto" and on_gpu and bf16_supported and param == torch.float32) else None
    elif autocast in ("off", "none", None):
        amp = None
    elif autocast in ("bfloat16", "float16"):
        amp = _DTYPES[autocast]
    else:
        raise DeviceError(f"{who}: autocast must be 'auto', 'off', 'bfloat16' or 'float16', got {autocast!r}")
    if torch.bfloat16 in (param, amp) and not bf16_supported:
        where = ("this GPU has no native bf16 (compute capability < 8.0)" if on_gpu
                 else "this CPU has no native bf16 instructions (AVX512-BF16 / AMX)")
        raise DeviceError(
            f"{who}: bf16 requested (dtype={dtype!r}, autocast={autocast!r}) on {device}, but {where}; "
            "set dtype='float32' (or 'auto') and autocast='off'" + ("" if on_gpu else ", or run on a GPU")
        )
    if amp is not None and amp == param:
        amp = None  # autocasting to the parameters' own dtype changes nothing
    return param, amp


def resolve_placement(cfg: Any, bundle_gpus: float, *, trained: bool, who: str) -> Placement:
    """The :class:`Placement` of a role built from ModelConfig `cfg` in a worker whose bundle
    reserves `bundle_gpus` GPUs (``Worker.context.num_gpus``)."""
    device = resolve_device(getattr(cfg, "device", "auto"), bundle_gpus=bundle_gpus, who=who)
    bf16 = cuda_supports_bf16(device) if device.type == "cuda" else cpu_supports_bf16()
    param, amp = resolve_precision(getattr(cfg, "dtype", "float32"), getattr(cfg, "autocast", "auto"), device,
                                   trained=trained, bf16_supported=bf16, who=who)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return Placement(device=device, param_dtype=param, autocast_dtype=amp)


def estimate_model_bytes(num_params: int, param_dtype: torch.dtype, *, trained: bool) -> int:
    """GPU bytes a role's model states take: weights, plus gradients and AdamW's two moments
    (in the parameters' dtype) for a trained role. Activations and the KV cache come on top."""
    per = param_dtype.itemsize * (4 if trained else 1)
    return int(num_params) * per


def check_gpu_memory(required: int, free: int, total: int, *, who: str, device: Any) -> None:
    """Raise :class:`DeviceError` when `required` bytes do not fit in `free` (of `total`) on `device`."""
    if required <= free:
        return
    gib = 1024 ** 3
    raise DeviceError(
        f"{who}: needs about {required / gib:.2f} GiB of GPU memory for its model states on {device}, but only "
        f"{free / gib:.2f} of {total / gib:.2f} GiB are free (other workers on this GPU hold the rest); colocate "
        "fewer roles on the GPU (max_colocate_count / trainer.colocated), use a smaller model or dtype='bfloat16', "
        "let the rollout release memory while training (RolloutConfig.sleep_level), or give the pool more GPUs"
    )


def check_model_fits(model: torch.nn.Module, placement: Placement, *, trained: bool, who: str) -> None:
    """Before moving `model` to a GPU: its states must fit in the GPU's free memory."""
    if not placement.is_cuda:
        return
    n = sum(p.numel() for p in model.parameters())
    free, total = torch.cuda.mem_get_info(placement.device)
    check_gpu_memory(estimate_model_bytes(n, placement.param_dtype, trained=trained), free, total,
                     who=who, device=placement.device)


def place_model(model: torch.nn.Module, placement: Placement, *, trained: bool, who: str) -> torch.nn.Module:
    """`model` in the placement's parameter dtype on its device (checking the GPU memory first).

    Non-persistent floating buffers (rotary ``inv_freq``) keep their dtype: they are derived
    constants, not weights, and casting them to bf16 would make a bf16 rollout's positions
    differ from the float32 policy's."""
    keep = [(mod, name, buf.dtype) for mod in model.modules() for name, buf in mod._buffers.items()
            if buf is not None and buf.is_floating_point() and name in mod._non_persistent_buffers_set]
    model = model.to(dtype=placement.param_dtype)
    for mod, name, dtype in keep:
        mod._buffers[name] = mod._buffers[name].to(dtype)  # type: ignore[union-attr]
    check_model_fits(model, placement, trained=trained, who=who)
    return model.to(placement.device)


def device_uuid(device: torch.device) -> str:
    """A name of the physical device (GPU UUID; ``cpu:<host>`` on the CPU): ranks on the same GPU match."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        uuid = getattr(props, "uuid", None)
        return f"cuda:{uuid}" if uuid is not None else f"cuda:{props.name}:{props.pci_bus_id if hasattr(props, 'pci_bus_id') else device.index}"
    import socket

    return f"cpu:{socket.gethostname()}"
