"""Model specs from a meta module and from a safetensors header agree."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dlo_fn.plan.spec import dtype_to_safetensors, spec_from_header, spec_from_module


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, dtype=torch.bfloat16)
        self.norm = nn.LayerNorm(dim)  # fp32 next to bf16: mixed dtypes in one block
        self.register_buffer("scale", torch.ones(dim))
        self.register_buffer("rope", torch.ones(dim), persistent=False)


class TwoLists(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.transformer_blocks = nn.ModuleList(Block(8) for _ in range(3))
        self.single_transformer_blocks = nn.ModuleList(Block(8) for _ in range(3))
        self.head = nn.Linear(8, 4)


def _meta() -> TwoLists:
    with torch.device("meta"):
        return TwoLists()


def test_spec_from_module_concatenates_lists_and_skips_non_persistent():
    spec = spec_from_module(_meta(), ("transformer_blocks", "single_transformer_blocks"))
    assert [b.name for b in spec.blocks] == [
        "transformer_blocks.0",
        "transformer_blocks.1",
        "transformer_blocks.2",
        "single_transformer_blocks.0",
        "single_transformer_blocks.1",
        "single_transformer_blocks.2",
    ]
    names = [t.name for t in spec.blocks[0].tensors]
    assert names == ["norm.bias", "norm.weight", "proj.bias", "proj.weight", "scale"]
    assert {t.kind for t in spec.blocks[0].tensors} == {"param", "buffer"}
    assert [t.name for t in spec.resident] == ["embed.weight", "embed.bias", "head.weight", "head.bias"]
    block_bytes = 8 * 8 * 2 + 8 * 2 + 8 * 4 * 2 + 8 * 4
    assert spec.block_bytes == (block_bytes,) * 6
    assert spec.total_bytes == 6 * block_bytes + (4 * 8 + 8 + 8 * 4 + 4) * 4


def test_spec_from_header_matches_module_spec():
    model = _meta()
    header = {"__metadata__": {"format": "pt"}}
    for name, t in model.state_dict().items():
        header[name] = {"dtype": dtype_to_safetensors(t.dtype), "shape": list(t.shape), "data_offsets": [0, 0]}
    from_header = spec_from_header(header)
    from_module = spec_from_module(model, ("transformer_blocks", "single_transformer_blocks"))
    strip = lambda s: [[(t.name, t.shape, t.dtype) for t in b.tensors] for b in s.blocks]  # noqa: E731
    assert [b.name for b in from_header.blocks] == [b.name for b in from_module.blocks]
    assert strip(from_header) == strip(from_module)
    assert from_header.total_bytes == from_module.total_bytes


def test_bad_paths_and_gaps_are_named():
    with pytest.raises(ValueError, match="'blocks' not found"):
        spec_from_module(_meta(), "blocks")
    header = {
        "blocks.0.w": {"dtype": "F32", "shape": [2]},
        "blocks.2.w": {"dtype": "F32", "shape": [2]},
    }
    with pytest.raises(ValueError, match=r"missing indices \[1\]"):
        spec_from_header(header)
    with pytest.raises(ValueError, match="unknown safetensors dtype 'Q4'"):
        spec_from_header({"blocks.0.w": {"dtype": "Q4", "shape": [2]}})
