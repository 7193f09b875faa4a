"""Mapping between our NNX parameter paths and HF safetensors tensor names.

Our stacked parameters hold every layer (and, for MoE experts, every expert) in
one array with leading [layer] / [layer, expert] axes; HF stores one tensor per
layer and expert. Every parameter keeps HF's own layout (linear weights
[out, in]), so a tensor maps to HF bytes without any transpose.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

Path = tuple[str, ...]

_LEAF = {"weight": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}
_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")
# Present in some HF checkpoints but derived, not learned.
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One of our parameters and the HF tensors it is made of."""

    path: Path
    template: str  # HF name with {layer} / {expert} placeholders
    stack_dims: int  # leading axes that enumerate HF tensors: 0, 1 (layer), 2 (layer, expert)

    def hf_names(self, shape: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], str]]:
        """(index into our leading stack axes, HF name) for every HF tensor."""
        for idx in itertools.product(*(range(n) for n in shape[: self.stack_dims])):
            yield idx, self.template.format(**dict(zip(("layer", "expert"), idx, strict=False)))

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[self.stack_dims :]


def tensor_map(path: Path) -> TensorMap:
    """The HF tensor(s) behind one of our parameter paths."""
    if path == ("lm_head", "embedding"):
        return TensorMap(path, "lm_head.weight", 0)
    if path[0] != "layers":
        return TensorMap(path, f"model.{'.'.join(path[:-1])}.{_LEAF[path[-1]]}", 0)
    inner = path[1:]
    if inner[:1] == ("mlp",) and len(inner) == 2 and inner[1] in _EXPERT_WEIGHTS:
        return TensorMap(path, f"model.layers.{{layer}}.mlp.experts.{{expert}}.{inner[1]}.weight", 2)
    return TensorMap(path, f"model.layers.{{layer}}.{'.'.join(inner[:-1])}.{_LEAF[inner[-1]]}", 1)
