"""The worker side of the vLLM engine: :class:`VLLMWorkerExtension`, which vLLM mixes into its worker
class (``worker_extension_cls``), and the checkpoint readers it uses. Everything here runs in vLLM's
worker process; :mod:`asyncrl.roles.engines.vllm_engine` (the controller side) only names this class
by its qualified name and reads the model directory's weight specs with :func:`weight_specs`.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Iterator

import torch

from asyncrl.roles.modeling.models import tensor_checksum

__all__ = ["VLLMWorkerExtension", "EXTENSION_QUALNAME", "safetensors_files", "weight_specs"]

EXTENSION_QUALNAME = f"{__name__}.VLLMWorkerExtension"
"""What ``AsyncEngineArgs(worker_extension_cls=...)`` takes: vLLM imports the class by this name."""


class VLLMWorkerExtension:
    """Methods vLLM mixes into its worker class (``worker_extension_cls``); they run in the worker process.

    The names carry an ``asyncrl_`` prefix because vLLM refuses an extension whose
    attributes clash with the worker's own.
    """

    def asyncrl_load_weights(self, payload: bytes) -> int:
        """Load a safetensors blob of checkpoint-named tensors in place; returns how many were loaded."""
        from safetensors.torch import load

        tensors = load(payload)
        # Worker.reload_weights restores checkpoint layout, loads through the model's
        # load_weights (fusing qkv / gate_up) and re-runs the kernel repacking.
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        _repack_tied_head(self.model_runner.model)  # type: ignore[attr-defined]
        received = _asyncrl_received(self)
        received.update({name: tensor_checksum(t) for name, t in tensors.items()})
        return len(tensors)

    def asyncrl_weights_checksum(self, model_dir: str, tie_word_embeddings: bool) -> dict[str, str]:
        """``{checkpoint name: checksum}`` of the weights the worker holds (see :meth:`VLLMEngine.weights_checksum`)."""
        received = _asyncrl_received(self)
        sums = _files_checksums(model_dir, skip=set(received))
        sums.update(received)
        # Read back whatever vLLM still keeps in checkpoint layout: a load that did not
        # land (or a kernel that rewrote its input) shows up as a mismatch here.
        readable = dict(_readable_checkpoint_tensors(self.model_runner.model))  # type: ignore[attr-defined]
        for name, t in readable.items():
            if name in sums:
                sums[name] = tensor_checksum(t)
        if tie_word_embeddings and "lm_head.weight" not in sums and "model.embed_tokens.weight" in sums:
            sums["lm_head.weight"] = sums["model.embed_tokens.weight"]  # a tied state_dict lists both names
        return sums


def _repack_tied_head(model: Any) -> None:
    """Re-run the LM head's post-load processing when it shares its weight with the input embedding.

    A tied checkpoint has no ``lm_head.weight`` to load, so vLLM's in-place reload never marks the head
    as loaded and skips its ``process_weights_after_loading`` -- but on CPU that step packs the weight for
    oneDNN (``layer.cpu_linear``): the head kept computing with the old embedding while every checksum
    (read from the shared parameter) looked right. Measured on SmolLM2-135M (tied): after one update,
    vLLM's log-probs were up to 0.125 off the updated policy's; with the repack, within fp32 noise.
    On GPU the step is a no-op for an unquantized head."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


def _asyncrl_received(worker: Any) -> dict[str, str]:
    if not hasattr(worker, "_asyncrl_received_checksums"):
        worker._asyncrl_received_checksums = {}
    return worker._asyncrl_received_checksums


def safetensors_files(model_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


def weight_specs(model_dir: str) -> dict[str, tuple[str, list[int]]]:
    """``{checkpoint name: (dtype, shape)}`` of the model directory's weights (what a load may send)."""
    from safetensors import safe_open

    specs: dict[str, tuple[str, list[int]]] = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                specs[name] = (str(sl.get_dtype()), list(sl.get_shape()))
    return specs


def _files_checksums(model_dir: str, skip: set[str]) -> dict[str, str]:
    from safetensors import safe_open

    sums: dict[str, str] = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name not in skip:
                    sums[name] = tensor_checksum(f.get_tensor(name))
    return sums


def _readable_checkpoint_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint-named views of the parameters vLLM still holds in checkpoint layout (TP=1).

    Fused projections (``qkv_proj``, ``gate_up_proj``) are split back along their
    output dim; vocab-padded embeddings are cut to the real vocabulary. Parameters a
    kernel has repacked or emptied (CPU linear layers) are skipped.
    """
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    for module_name, module in model.named_modules():
        short = module_name.rsplit(".", 1)[-1]
        for pname, param in module.named_parameters(recurse=False):
            if param.numel() == 0 or param.is_meta:
                continue
            full = f"{module_name}.{pname}" if module_name else pname
            sizes = getattr(module, "output_sizes", None)
            if short in packed and sizes and param.dim() >= 1 and param.shape[0] == sum(sizes):
                parts = torch.split(param.detach(), list(sizes), dim=0)
                for sub, part in zip(packed[short], parts):
                    yield full.replace(f".{short}.", f".{sub}."), part
                continue
            if short in packed:
                continue  # fused but not splittable as expected: cannot name its parts
            org = getattr(module, "org_vocab_size", None)
            if org is not None and param.dim() >= 1 and param.shape[0] > org:
                yield full, param.detach()[:org]
                continue
            yield full, param.detach()
