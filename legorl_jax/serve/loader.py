"""Loads an HF checkpoint directory into a running `Engine`, and reloads
weights into it from another directory of the same architecture, or from a
PEFT adapter directory (a LoRA run's version), merged into a copy of the last
full checkpoint loaded: each version onto the base, never onto the previous
merge. The base is held in host memory from the first adapter on (one more
copy of the weights), so an adapter version reads only the adapter; merged
weights serve at the base's speed (`scripts/bench_lora_serve.py`)."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from legorl_jax.core.allocator import release_freed_memory
from legorl_jax.core.weight_layout import ADAPTER_CONFIG_FILE
from legorl_jax.serve.engine import Engine
from legorl_jax.serve.step import DeviceStep

if TYPE_CHECKING:
    from legorl_jax.models.config import DType

# Upper bound on the [slots, chunk, vocab] float32 logits of a step that returns
# prompt logprobs; such steps take smaller chunks to stay under it (other steps
# compute logits at one position per row only).
LOGITS_BUDGET_BYTES = 256 * 2**20
# Upper bound on one step's float32 attention scores [rows, heads, chunk, tile]
# (`paged_attention` scores one tile of keys at a time): many rows take smaller chunks.
SCORES_BUDGET_BYTES = 64 * 2**20
# Positions per KV block: the unit of allocation and of prefix-cache reuse.
BLOCK_SIZE = 32


class WeightsError(ValueError):
    """A weights directory that cannot be served (missing, or another architecture)."""


@dataclasses.dataclass
class ServedModel:
    """What the HTTP layer needs: the engine, the tokenizer and where weights came from."""

    engine: Engine
    tokenizer: Any
    name: str
    model_dir: Path
    weights_path: Path
    config: Any
    graphdef: Any
    dtype: DType
    _reload_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # The full checkpoint adapters merge onto: its directory, and its model once an adapter needed it.
    _base_path: Path | None = None
    _base: Any = None

    def reload(self, weights_path: str | Path) -> int:
        """Loads weights from `weights_path` (an HF directory, or a PEFT adapter merged onto
        the base) and installs them. Returns the new weight version. Serialised: one reload at a time."""
        path = Path(weights_path)
        with self._reload_lock:
            if (path / ADAPTER_CONFIG_FILE).is_file():
                graphdef, state, config = self._merged(path)
            else:
                graphdef, state, config = _load(path, self.dtype)
                self._base_path, self._base = path, None
            if config != self.config:
                raise WeightsError(f"{path}: architecture differs from the served model; restart the engine for it")
            if graphdef != self.graphdef:
                raise WeightsError(f"{path}: parameter structure differs from the served model")
            version = self.engine.swap_weights(state)
            self.weights_path = path
            del state
            release_freed_memory()  # the load's buffers, and the old weights once the engine drops them
            return version

    def _merged(self, adapter_dir: Path) -> tuple[Any, Any, Any]:
        from legorl_jax.models import CheckpointError, from_hf
        from legorl_jax.models.lora import LoraError, load_peft, merge_adapters

        base_path = self._base_path or self.model_dir
        try:
            if self._base is None:
                self._base = nnx.split(from_hf(base_path, dtype=self.dtype))
            model = nnx.merge(*self._base, copy=True)  # without a copy, merging would write into the base
            merge_adapters(load_peft(model, adapter_dir))
        except (CheckpointError, LoraError, OSError, KeyError, ValueError) as exc:
            raise WeightsError(f"{adapter_dir}: cannot merge the adapter onto {base_path}: {exc}") from exc
        model.prepare_for_serving()
        graphdef, state = nnx.split(model)
        return graphdef, state, model.config


def trained_context(path: Path) -> int:
    """The checkpoint's max_position_embeddings: the default context, as vLLM's."""
    try:
        value = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{path}: cannot read config.json: {exc}") from exc
    if not isinstance(value, int) or value < 1:
        raise WeightsError(f"{path}: config.json has no max_position_embeddings; give the context (--max-model-len)")
    return value


def _load(path: Path, dtype: DType) -> tuple[Any, Any, Any]:
    if not (path / "config.json").is_file():
        raise WeightsError(f"{path}: not an HF model directory (no config.json)")
    from legorl_jax.models import CheckpointError, from_hf

    try:
        model = from_hf(path, dtype=dtype)
    except (CheckpointError, OSError, KeyError, ValueError) as exc:
        raise WeightsError(f"{path}: cannot load weights: {exc}") from exc
    model.prepare_for_serving()  # the engine's steps: decode kernels, weights read in place
    graphdef, state = nnx.split(model)
    return graphdef, state, model.config


def load_tokenizer(path: Path) -> Any:
    """The directory's tokenizer. A `tokenizer.json` is read by the fast class
    alone: `AutoTokenizer` imports torch, a quarter GB of resident memory the
    engine never uses; other directories go through `AutoTokenizer`."""
    if (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(model_dir: Path, tokenizer: Any) -> frozenset[int]:
    """EOS ids from generation_config.json (int or list), plus the tokenizer's."""
    ids: set[int] = set()
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([value] if isinstance(value, int) else value or [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def max_chunk_for(slots: int, vocab: int, requested: int) -> int:
    return max(1, min(requested, LOGITS_BUDGET_BYTES // (4 * slots * vocab)))


# Sequences decoded together unless told (vLLM's --max-num-seqs).
DEFAULT_MAX_NUM_SEQS = 32

# The default pool's least size: a small model's weights would leave room for a
# request or two, and its rollouts would queue; every slot at full length still caps it.
KV_FLOOR_BYTES = 512 * 2**20


def pool_blocks(state: Any, config: Any, kv_dtype: str, budget: int | None, slots: int, max_len: int) -> int:
    """Blocks in the KV pool (block 0 reserved): `budget` bytes of K/V, by
    default the most of the weights' size, KV_FLOOR_BYTES and one max_len
    sequence, and never more than every slot at max_len could use."""
    from legorl_jax.models.kv_cache import kv_bytes_per_token

    per_block = BLOCK_SIZE * kv_bytes_per_token(config, kv_dtype)
    if budget is None:
        weights = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
        budget = max(weights, KV_FLOOR_BYTES, -(-max_len // BLOCK_SIZE) * per_block)
    if budget < per_block:
        raise WeightsError(f"KV cache budget of {budget} bytes is under one block ({per_block} bytes)")
    return 1 + min(budget // per_block, slots * -(-max_len // BLOCK_SIZE))


def load_served_model(
    model_dir: str | Path,
    *,
    max_slots: int = DEFAULT_MAX_NUM_SEQS,
    max_len: int | None = None,
    max_chunk: int = 512,
    dtype: DType = "float32",
    kv_cache_dtype: str = "auto",
    kv_cache_memory_bytes: int | None = None,
    enable_prefix_caching: bool = True,
    served_name: str | None = None,
) -> ServedModel:
    """Builds and starts the engine for an HF directory (weights + tokenizer).

    max_len None serves the context the checkpoint was trained for (its
    config's max_position_embeddings), as vLLM does. kv_cache_dtype "auto"
    keeps K/V in the compute dtype; kv_cache_memory_bytes
    is the pool's size (default: the weights' size, 512 MiB or one max_len
    sequence, whichever is most). Requests beyond what the
    pool holds wait for blocks. enable_prefix_caching off: every prompt
    prefills in full (vLLM's --no-enable-prefix-caching)."""
    from legorl_jax.models import init_kv_cache

    path = Path(model_dir)
    graphdef, state, config = _load(path, dtype)  # first: it names a directory without config.json
    max_len = max_len or trained_context(path)
    # Before the pool: what reading and converting the checkpoint used goes
    # back to the system instead of staying in the heap beside the pool.
    release_freed_memory()
    tokenizer = load_tokenizer(path)
    kv_dtype = config.compute_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    blocks = pool_blocks(state, config, kv_dtype, kv_cache_memory_bytes, max_slots, max_len)
    engine = Engine(
        DeviceStep(graphdef),
        state,
        lambda: init_kv_cache(config, blocks, BLOCK_SIZE, kv_dtype),
        slots=max_slots,
        max_len=max_len,
        vocab_size=config.vocab_size,
        eos_token_ids=eos_token_ids(path, tokenizer),
        max_chunk=max_chunk,
        max_prompt_chunk=max_chunk_for(max_slots, config.vocab_size, max_chunk),
        max_step_pairs=SCORES_BUDGET_BYTES // (4 * config.num_heads),
        prefix_caching=enable_prefix_caching,
    ).start()
    return ServedModel(
        engine=engine,
        tokenizer=tokenizer,
        name=served_name or str(model_dir),
        model_dir=path,
        weights_path=path,
        config=config,
        graphdef=graphdef,
        dtype=dtype,
    )
