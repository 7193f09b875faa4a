"""Worker methods the launcher adds to vLLM (`--worker-extension-cls`), run inside
vLLM's worker processes, in vLLM's own environment: this file imports nothing of
the project, and its directory goes on the engine's PYTHONPATH.

`legorl_reload_weights(weights_path)` is vLLM's in-place `reload_weights` made
right for tied embeddings. vLLM's layer-wise reload (model_loader/reload/) moves
every layer to the meta device, rebuilds each from the checkpoint's tensors and
reruns its post-load processing. A checkpoint with tied embeddings has no
`lm_head.weight`: the LM head loads nothing ("ParallelLMHead: Failed to load
weights"), so its processing is not rerun. Its weight is the embedding's and
does hold the new values, but on CPU that processing is what packed the weight
into the oneDNN handle the head's GEMM runs on (`cpu_linear`,
model_executor/layers/utils.py), which still holds the old ones: the engine
computes with the new embedding and the old head. Found by the served-weights
probe on vLLM 0.32's CPU build. After the reload this reruns the head's
processing (on GPU it does nothing for an unquantized head).
"""

from __future__ import annotations

from typing import Any


class LegorlWorkerExtension:
    # No attribute of vLLM's Worker may be named here: vLLM refuses an extension that shadows one.

    def legorl_reload_weights(self, weights_path: str) -> None:
        worker: Any = self  # mixed into vLLM's Worker, whose reload_weights and model_runner this uses
        worker.reload_weights(weights_path=weights_path)
        config = getattr(worker, "vllm_config", None)  # None in the project's stand-in: no model to tie
        if config is None or not getattr(config.model_config.hf_text_config, "tie_word_embeddings", False):
            return
        model = worker.model_runner.get_model()
        head, embed = model.lm_head, model.model.embed_tokens
        head.weight = embed.weight  # vLLM's reload leaves them tied; set again in case a version does not
        head.quant_method.process_weights_after_loading(head)
