"""Run in a subprocess by test_sharding.py with 8 fake CPU devices.

argv: checkpoint dir, mesh sizes "data,fsdp,tensor,expert". Prints one JSON
line: max |logit diff| sharded vs one device, and the observed shardings.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from legorl_jax.models import batch_sharding, from_hf, make_mesh


def main() -> None:
    path, sizes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    assert jax.device_count() == 8, jax.devices()
    mesh = make_mesh(*sizes)
    tokens = np.random.default_rng(0).integers(0, 256, (8, 24), dtype=np.int32)

    @nnx.jit
    def forward(model: nnx.Module, toks: jax.Array) -> jax.Array:
        return model(toks)

    single = np.asarray(forward(from_hf(path), jnp.asarray(tokens)))
    sharded_model = from_hf(path, mesh=mesh)
    sharded = forward(sharded_model, jax.device_put(tokens, batch_sharding(mesh)))
    specs, shard_shapes = {}, {}
    for p, var in nnx.to_flat_state(nnx.state(sharded_model, nnx.Param)):
        value = var.get_value()
        key = "/".join(p)
        specs[key] = [None if a is None else a for a in value.sharding.spec]
        shard_shapes[key] = [list(value.shape), list(value.addressable_shards[0].data.shape)]
    print(
        json.dumps(
            {
                "max_diff": float(np.abs(np.asarray(sharded) - single).max()),
                "devices": len(sharded.sharding.device_set),
                "specs": specs,
                "shard_shapes": shard_shapes,
            }
        )
    )


if __name__ == "__main__":
    main()
