"""Typed run configuration: one pydantic model per part, loaded from YAML.

Every model forbids unknown fields, so a typo in a YAML file or a `--set`
override is an error that names the field instead of a silently ignored key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from legorl_jax.core.body_limit import DEFAULT_MAX_REQUEST_BYTES
from legorl_jax.core.storage_location import checked_location

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "demo.yaml"


def cache_root() -> Path:
    """Where set-up and first runs keep what they build and install: `$LEGORL_CACHE`, default `.cache/`."""
    return Path(os.environ.get("LEGORL_CACHE", REPO_ROOT / ".cache"))


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Strict):
    """Low-rank adapters trained on a frozen base (`legorl_jax/models/lora.py`)."""

    rank: int = Field(16, gt=0, description="The adapters' rank r.")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: an adapter adds (alpha / rank) * B @ A.")
    dropout: float = Field(
        0.0,
        description="Dropout on the adapters' input. Only 0: the engine samples without dropout, and a policy "
        "trained with it would not be the policy that sampled (importance ratios off by the dropout noise).",
    )
    targets: list[LoraTarget] = Field(
        list(get_args(LoraTarget)),
        min_length=1,
        description="Projections that get adapters: attention (q/k/v/o_proj) and the dense MLP (gate/up/down_proj).",
    )
    publish: Literal["adapter", "merged"] = Field(
        "adapter",
        description="What each published version is. adapter: the PEFT adapter alone (its weights.json names the "
        "base checkpoint's digest), a small fraction of the model's bytes; hosts load it onto the base they serve "
        "(vLLM through its LoRA path, the embedded engine merges it into its copy of the base). merged: a full "
        "checkpoint with the adapters folded into the weights, for an engine that cannot take adapters, or to use "
        "fleet.weights_full_every deltas.",
    )
    experts: bool = Field(
        False,
        description="MoE models: adapters on the experts too. Only false (not built yet): a MoE model trains "
        "adapters on attention, its experts and router stay frozen.",
    )

    @model_validator(mode="after")
    def _supported(self) -> LoraConfig:
        if self.dropout != 0.0:
            raise ValueError(f"dropout must be 0, got {self.dropout} (see the field's description)")
        if self.experts:
            raise ValueError("experts: true is not supported yet; experts: false adapts attention only on MoE")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets has duplicates: {self.targets}")
        return self


class ModelRunConfig(Strict):
    """The policy network."""

    path: str | None = Field(
        None,
        description="HF model directory (config.json + safetensors). None builds the embedded demo model.",
    )
    demo_model: Literal["lego", "cli"] = Field(
        "lego",
        description="Which embedded demo model `path: null` builds (once; cached under .cache/demo_model): lego = "
        "warm-started on demonstrations through the lego harness (a few minutes); cli = through the real harness "
        "CLIs in Docker (legorl_jax/demo/cli_model.py; up to about 1.5 hours on 2 CPU cores).",
    )
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype of the stored (master) parameters."
    )
    compute_dtype: Literal["float32", "bfloat16"] = Field("float32", description="Dtype of activations and matmuls.")
    remat: Literal["none", "full", "dots_saveable"] = Field(
        "none", description="Rematerialisation policy of the scanned layer body."
    )
    attention_kernel: Literal["auto", "xla", "cudnn", "splash", "blockwise"] = Field(
        "auto",
        description="Attention implementation of training steps: auto = cuDNN's fused kernel on NVIDIA GPUs with "
        "16-bit compute, Pallas splash attention on TPU (rows and head_dim multiples of 128), elsewhere blockwise "
        "(tiles with a running softmax; memory linear in the row) for rows of two or more 128-multiple tiles and "
        "XLA's dense scores otherwise; cudnn and splash fail off their hardware, splash and blockwise on rows "
        "that are not multiples of 128. See legorl_jax/models/attention.py.",
    )
    max_seq_len: int = Field(4096, gt=0, description="Longest packed row the learner trains on.")
    lora: LoraConfig | None = Field(
        None,
        description="Train low-rank adapters on a frozen base instead of every weight; null trains the full model.",
    )


class MeshConfig(Strict):
    """Learner device mesh. -1 on one axis takes all remaining devices."""

    data: int = Field(1, description="Pure data-parallel axis.")
    fsdp: int = Field(-1, description="Data-parallel axis that also shards parameters.")
    tensor: int = Field(1, ge=1, description="Tensor-parallel axis (heads, MLP width).")
    expert: int = Field(1, ge=1, description="Expert-parallel axis (MoE).")

    @model_validator(mode="after")
    def _one_wildcard(self) -> MeshConfig:
        sizes = [self.data, self.fsdp, self.tensor, self.expert]
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError("at most one mesh axis may be -1")
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError("mesh axis sizes must be positive or -1")
        return self


class OptimizerConfig(Strict):
    learning_rate: float = Field(1e-6, gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    total_steps: int = Field(
        1000, gt=0, description="Horizon of the decay schedule; unset in a run config, the run's total_steps."
    )
    weight_decay: float = Field(0.0, ge=0)
    final_lr_fraction: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Where cosine or linear decay ends, as a fraction of the peak rate (0: decay to 0).",
    )
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.999, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip_norm: float = Field(1.0, gt=0, description="Global-norm gradient clip.")
    # Set when total_steps was taken from the run's: a dumped config then leaves it out, so that
    # reloading it with another run length still spans the run.
    _horizon_from_run: bool = PrivateAttr(False)


class CheckpointConfig(Strict):
    every_steps: int = Field(10, gt=0)
    keep: int = Field(3, gt=0, description="Checkpoints kept on disk.")
    async_save: bool = True
    directory: str | None = Field(
        None,
        description="The run's checkpoint directory: a local path or gs://bucket/prefix that every learner "
        "process can write (None: <run dir>/checkpoints).",
    )

    @field_validator("directory")
    @classmethod
    def _location(cls, value: str | None) -> str | None:
        return None if value is None else checked_location(value)


class LearnerConfig(Strict):
    mesh: MeshConfig = MeshConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    micro_batch_tokens: int = Field(
        16384, gt=0, description="Token budget of one micro-batch; gradients accumulate across them."
    )
    length_buckets: list[int] = Field(
        [512, 1024, 2048, 4096], min_length=1, description="Packed row lengths; few buckets, few compilations."
    )
    logprob_chunk_size: int = Field(
        1024, gt=0, description="Sequence chunk for logprobs, so [B, T, V] float32 logits never exist."
    )
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="What happens to a sequence longer than the largest bucket."
    )
    share_prefixes: bool = Field(
        True, description="Compute prompt prefixes that sequences share (system, tools, task) once per micro-batch."
    )
    heartbeat_timeout_s: int = Field(
        60,
        ge=5,
        description="Several processes (docs/multihost.md): how long a process may go silent before the "
        "others stop with an error naming it.",
    )


class SamplingConfig(Strict):
    """Sampling the proxy enforces on every model call, whatever the harness asks."""

    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    max_tokens: int = Field(1024, gt=0, description="Completion-token cap per model call.")


class RLConfig(Strict):
    advantage: str = Field("grpo", description="Advantage estimator (registry name): grpo, dr_grpo, rloo.")
    loss: str = Field(
        "ppo_clip", description="Policy loss (registry name): ppo_clip, gspo, cispo; nll is `legorl sft`'s."
    )
    aggregation: Literal["token_mean", "seq_mean_token_mean", "constant"] = "token_mean"
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0, description="DAPO clip-higher upper bound.")
    tis_cap: float | None = Field(2.0, gt=0, description="Token-level truncated IS cap; None disables.")
    mis_cap: float | None = Field(None, gt=0, description="Sequence-level masked IS cap; None disables.")
    kl_coef: float = Field(0.0, ge=0, description="KL-to-reference coefficient; 0 skips the reference pass.")
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    group_size: int = Field(8, ge=2, description="Trials per (task, harness config) group.")
    groups_per_step: int = Field(8, gt=0, description="Informative groups per optimizer step.")
    dynamic_sampling: bool = Field(True, description="Drop zero-variance groups and sample more.")
    max_sampling_rounds: int = Field(
        4,
        gt=0,
        description="Rounds of sampling per step at most, so a policy that solves nothing (or everything) "
        "cannot stall the run; the step trains on the informative groups it got.",
    )
    max_policy_lag: int = Field(0, ge=0, description="0 is synchronous; k overlaps rollouts with training.")
    sampling: SamplingConfig = SamplingConfig()


# Engine kinds that are chat teachers: called through a chat API, their answers re-rendered as student tokens.
CHAT_ENGINE_KINDS = ("openai_chat", "anthropic")


class EngineConfig(Strict):
    kind: Literal["embedded", "vllm", "external", "openai_chat", "anthropic"] = Field(
        "embedded",
        description="embedded: our JAX engine; vllm: launch vllm serve; external: use url as is (vLLM's token "
        "surface); openai_chat / anthropic: a chat teacher at url, called through its OpenAI Chat Completions or "
        "Anthropic Messages API, whose answers are recorded re-rendered with the student's chat template (no "
        "logprobs: episodes for supervised fine-tuning, never for RL).",
    )
    url: str | None = Field(
        None,
        description="Engine base URL (external, openai_chat, anthropic: the server's root, without /v1), or filled "
        "in once launched.",
    )
    teacher_model: str | None = Field(
        None, description="openai_chat / anthropic: the model name the teacher's API is asked for."
    )
    api_key_env: str | None = Field(
        None,
        description="openai_chat / anthropic: environment variable holding the teacher's API key (sent as a "
        "Bearer token, or x-api-key), never the YAML; unset: the placeholder EMPTY, for servers that take none.",
    )
    host: str = "127.0.0.1"
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of a launched engine; 0 picks a free one, so hosts on one machine never clash.",
    )
    max_batch: int = Field(32, gt=0, description="Sequences decoded together (continuous batching).")
    max_context: int | None = Field(
        None,
        gt=0,
        description="Context (prompt + completion) a launched engine serves (--max-model-len); default: the "
        "model's own (config.json's max_position_embeddings), as `legorl serve` and `vllm serve` do, so a "
        "harness's 20k-token prompt fits a real checkpoint. With kind external the engine's own /v1/models "
        "max_model_len is used instead; with a chat teacher it bounds the prompt in the student's tokens "
        "(default: the student model's own).",
    )
    startup_timeout_s: float = Field(
        900.0,
        gt=0,
        description="How long the rollout server waits for the engine's /health and /v1/models "
        "(a launched engine loading its weights, each time it starts, or an external one not up yet) before it "
        "gives up.",
    )
    extra_args: list[str] = Field([], description="Extra arguments for `vllm serve`.")
    # Options of a launched engine: `legorl serve --help`, and for vLLM the flag each maps to.
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None,
        description="Weights and compute dtype (--dtype); None: the engine's default (embedded: float32; "
        "vllm: the checkpoint's on GPU, bfloat16 for a float32 checkpoint on its CPU build).",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="K/V storage dtype (--kv-cache-dtype; auto: the compute dtype; vllm has no float32)."
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        gt=0,
        description="Bytes of the KV-cache pool (--kv-cache-memory-bytes); requests beyond it wait (None: "
        "embedded: the weights' size, 512 MiB or one max_context sequence, whichever is most; vllm: from its "
        "--gpu-memory-utilization on GPU, 2 GiB on its CPU build).",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse the K/V of a prompt prefix already computed (--enable-prefix-caching / "
        "--no-enable-prefix-caching).",
    )
    max_chunk: int = Field(512, gt=0, description="Embedded: largest prefill chunk (tokens) per engine step.")

    @model_validator(mode="after")
    def _engine_options(self) -> EngineConfig:
        # Set where no flag takes them they would be dropped without a word; say where they go instead.
        # Compared with the defaults, not with the fields given, so that a dumped config loads again.
        fields = type(self).model_fields
        launched = ("dtype", "kv_cache_dtype", "kv_cache_memory_bytes", "enable_prefix_caching", "max_chunk")
        stray = [n for n in launched if getattr(self, n) != fields[n].default]
        if self.kind not in ("embedded", "vllm") and stray:
            raise ValueError(
                f"{', '.join(stray)}: options of an engine this process launches, not of kind {self.kind!r} "
                "(set them where that engine is started)"
            )
        chat = self.kind in CHAT_ENGINE_KINDS
        if chat and not (self.url and self.teacher_model):
            raise ValueError(f"kind {self.kind!r} needs url and teacher_model (the teacher's server and model)")
        given = [n for n in ("teacher_model", "api_key_env") if getattr(self, n) is not None]
        if not chat and given:
            raise ValueError(f"{', '.join(given)}: settings of a chat teacher (kind openai_chat or anthropic)")
        if self.kind == "vllm" and "max_chunk" in stray:
            raise ValueError(
                "max_chunk: vLLM has no per-step prefill chunk of this meaning (its --max-num-batched-tokens "
                "caps a step's tokens over all requests, --long-prefill-token-threshold one request's, and not "
                "when it runs alone); pass the one you mean in engine.extra_args"
            )
        if self.kind == "vllm" and self.kv_cache_dtype == "float32":
            raise ValueError("kv_cache_dtype: vLLM's --kv-cache-dtype has no float32; use auto or bfloat16")
        return self


class SessionCaps(Strict):
    """Limits of one proxy session. A session may set its own (admin API);
    the proxy config's are every other session's."""

    max_model_calls: int = Field(
        50, gt=0, description="Model calls (engine calls started) before the session refuses more."
    )
    max_total_tokens: int = Field(
        1_048_576,
        gt=0,
        description="Cap on the assembled sequences' total length. The default admits a real harness session "
        "in the worst case of no shared prefix: max_model_calls (50) calls of a 20k-token prompt (Claude Code's "
        "is 20k+), each its own sequence; configs/demo.yaml sets a small cap for its toy tasks.",
    )
    max_wall_s: float = Field(1800.0, gt=0, description="Seconds from creation after which calls are refused.")


class ProxyConfig(SessionCaps):
    """The token-capture proxy; its session caps are every session's default."""

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port.")
    keepalive_s: float = Field(15.0, gt=0, description="SSE keep-alive comment interval.")
    tool_call_format: Literal["hermes", "qwen3_coder", "llama3_json"] = Field(
        "hermes", description="How the model writes tool calls, named after the vLLM tool parser that reads them."
    )
    model_name: str = Field(
        "policy",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$",
        description="The model name harnesses are given and /v1/models lists; calls reach the engine under its own "
        "served name (a launched engine serves its weights path, which some CLIs refuse: Claude Code takes no '/'). "
        "Harness prompts can quote it (Claude Code's names its model), so a policy warm-started on CLI "
        "demonstrations should be given the name they were recorded under.",
    )
    chat_template: str | None = Field(
        None, description="A Jinja chat template file used instead of the tokenizer's (one that renders tools, say)."
    )
    max_sessions: int = Field(
        4096, gt=0, description="Live sessions kept at most; the admin API answers 429 past it until some are deleted."
    )
    max_request_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BYTES,
        gt=0,
        description="Largest request body taken (model calls, token counts, admin); larger ones get 413.",
    )
    session_idle_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="A session made through the admin API whose key goes unused (no model call, no trajectory "
        "read) this long expires; its trajectory is kept as long again for one fetch, then lost (both said in a "
        "WARNING and to a later fetch). A trial's sessions end with their trial instead.",
    )

    def session_caps(self) -> SessionCaps:
        return SessionCaps.model_validate(self.model_dump(include=set(SessionCaps.model_fields)))


class HarnessToolsConfig(Strict):
    """Harness CLIs installed on this host (scripts/setup), mounted read-only into Docker sandboxes,
    which reach no registry to install them from. Unset: CLI harnesses need CLIs baked into the task image."""

    npm_dir: str | None = Field(
        None, description="npm prefix whose node_modules/.bin holds the npm harness CLIs (setup: .cache/harness-cli)."
    )
    node: str | None = Field(None, description="Host node binary for CLIs that are node scripts; None: node on PATH.")
    pip_venvs: list[str] = Field(
        [],
        description="Virtualenvs of the pip harnesses (setup: .cache/mini-venv), each made from a relocatable "
        "Python (pyenv, python-build-standalone), which is mounted too: the sandbox's python3 plays no part.",
    )


class SandboxConfig(Strict):
    kind: Literal["auto", "docker", "local"] = Field(
        "auto",
        description="auto: Docker when a daemon answers; without one, the local (unisolated) sandbox only when "
        "allow_local_fallback is set, else the server refuses to start. local: always the local sandbox.",
    )
    allow_local_fallback: bool = Field(
        False,
        description="With kind auto, run trials in the local sandbox when no Docker daemon answers. It is not "
        "isolated (an agent may reach the host's files and, without bubblewrap, its network): demos only.",
    )
    unenforceable_storage: Literal["refuse", "ignore"] = Field(
        "refuse",
        description="A task sets environment.storage_mb but the Docker daemon cannot cap a container's disk (only "
        "overlay2 on xfs with pquota, btrfs and zfs can): refuse its trials (env_failure naming why), or run them "
        "without a disk limit after one warning.",
    )
    cpus: float = Field(1.0, gt=0)
    memory_mb: int = Field(2048, gt=0)
    pids_limit: int = Field(512, gt=0)
    network: Literal["proxy_only", "none"] = "proxy_only"
    harness_tools: HarnessToolsConfig = HarnessToolsConfig()


class HarnessSpec(Strict):
    name: str = Field(description="Registered harness: lego, claude-code, opencode, codex, mini-swe-agent, ...")
    options: dict[str, Any] = Field({}, description="Harness options; for lego, its axes.")
    weight: float = Field(1.0, gt=0, description="Share of the groups, relative to the other harnesses' weights.")


class HarnessMixConfig(Strict):
    harnesses: list[HarnessSpec] = Field([HarnessSpec(name="lego")], min_length=1)


class DemoVariantsConfig(Strict):
    """Which generated demo tasks exist (see rollout_server/demo_families.py)."""

    families: list[str] = Field(
        ["write-word", "count-word", "add-setting", "move-file", "count-errors", "count-lines"],
        min_length=1,
        description="Task families.",
    )
    train_per_family: int = Field(20, gt=0, description="Slot combinations per family that train.")
    eval_per_family: int = Field(3, ge=0, description="Held-out slot combinations per family that evaluate.")
    seed: int = Field(0, description="Seed of the train/held-out split.")


class TasksConfig(Strict):
    train: list[str] = Field([], description="Task roots (Harbor directories) or JSONL index files.")
    eval: list[str] = Field([], description="Held-out task roots for evaluation.")
    demo: bool = Field(
        False,
        description="Add the generated demo tasks: their training variants train, their held-out variants "
        "evaluate (the project's hand-written demo tasks are served too).",
    )
    demo_variants: DemoVariantsConfig = DemoVariantsConfig()
    eval_every: int = Field(
        10, gt=0, description="Evaluate on the held-out tasks before the first step, every N steps and after the last."
    )
    location_roots: list[str] = Field(
        [],
        description="Directories a rollout server loads a Rollout request's TaskRef.location from, besides the "
        "train/eval roots, the shipped demo tasks and the generated demo-task cache; any other location is refused.",
    )


class GrpcSecurityConfig(Strict):
    """Bearer token and TLS on the rollout servers' gRPC endpoint; a server and its
    clients read the same section. Secrets come from the environment or a file,
    never from the YAML itself."""

    token_env: str | None = Field(
        None, description="Environment variable holding the bearer token; servers require it, clients send it."
    )
    token_file: str | None = Field(None, description="File holding the bearer token (instead of token_env).")
    tls_cert: str | None = Field(None, description="Server: PEM certificate chain; with tls_key, serve TLS only.")
    tls_key: str | None = Field(None, description="Server: PEM private key of tls_cert.")
    tls_ca_cert: str | None = Field(
        None, description="Client: PEM CA bundle that signed the servers' certificates; set, clients connect over TLS."
    )

    @model_validator(mode="after")
    def _consistent(self) -> GrpcSecurityConfig:
        if self.token_env and self.token_file:
            raise ValueError("set token_env or token_file, not both")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        return self


class FleetConfig(Strict):
    servers: list[str] = Field([], description="Rollout server addresses host:port; empty runs one in-process.")
    capacity_per_server: int = Field(8, gt=0, description="Trials per server at once (in-process server).")
    max_queued_per_server: int = Field(
        256, ge=0, description="Trials a server accepts beyond its capacity, waiting for a slot; more are refused."
    )
    max_trial_timeout_s: float = Field(
        3600.0, gt=0, description="Longest agent or verifier timeout a Rollout request may ask a server for."
    )
    weights_idle_timeout_s: float = Field(
        120.0, gt=0, description="A StreamWeights call that sends nothing for this long is ended and discarded."
    )
    max_retries: int = Field(2, ge=0, description="Re-issues of a trial whose server died.")
    rpc_timeout_s: float = Field(3600.0, gt=0)
    agent_timeout_s: float = Field(600.0, gt=0)
    verifier_timeout_s: float = Field(120.0, gt=0)
    security: GrpcSecurityConfig = GrpcSecurityConfig()
    weights_dir: str | None = Field(
        None,
        description="Where published weights go: a local path or gs://bucket/prefix that every rollout server "
        "can read (None: <run dir>/weights).",
    )
    weights_location_roots: list[str] = Field(
        [],
        description="Directories a rollout server loads an UpdateWeights local location (path or file://) from, "
        "besides logging.run_dir (where the learner publishes by default) and fleet.weights_dir when it is local; "
        "any other local location is refused, `..` and symlinks resolved first.",
    )
    weights_transport: Literal["location", "stream"] = Field(
        "location",
        description="location: servers load the published directory themselves (shared storage); stream: the "
        "trainer streams it to each server over gRPC StreamWeights (no shared storage needed).",
    )
    weights_full_every: int = Field(
        1,
        ge=1,
        description="Publish a full checkpoint every this many versions and, between them, only the elements that "
        "changed (bit-exact, checked by digest; servers that fell behind catch up from the last full one). 1: "
        "every version in full.",
    )
    weights_relay: bool = Field(
        False,
        description="With weights_transport stream: send each version once, to the first server, which relays it "
        "down the chain of servers (the trainer's link carries one copy, whatever the fleet's size).",
    )


class LoggingConfig(Strict):
    run_dir: str = Field("runs", description="Parent of every run's directory.")
    run_name: str = "demo"
    tensorboard: bool = True
    progress: bool = Field(True, description="Show progress bars on long work.")
    rollout_tokens: Literal["all", "train", "none"] = Field(
        "all",
        description="Token records in rollouts.jsonl (ids, token texts, behaviour and learner logprobs): "
        "for every sequence, only for the sequences the learner trained on, or for none (sampled text only).",
    )


class SupervisedConfig(Strict):
    """`legorl sft`: supervised fine-tuning on rollouts directories (the learner, optimizer and
    checkpoints are the `learner:` section's; the loss is the sampled tokens' NLL)."""

    epochs: int = Field(1, gt=0, description="Passes over the kept episodes' sequences (unless steps is set).")
    steps: int | None = Field(None, gt=0, description="Optimizer steps; None: as many as `epochs` take.")
    batch_size: int = Field(8, gt=0, description="Sequences per optimizer step.")
    evaluate: bool = Field(
        True,
        description="Held-out evaluation (tasks.eval, or the demo's held-out variants) of the starting and the "
        "fine-tuned model, on a rollout server in this process; skipped when the config has no held-out tasks.",
    )


class Config(Strict):
    seed: int = Field(
        0,
        description="The run's seed: task order, harness draws and every sampled rollout (each group, trial and "
        "model call samples from a seed derived from it), so a run with the same seed and weights samples the same.",
    )
    total_steps: int = Field(100, gt=0)
    model: ModelRunConfig = ModelRunConfig()
    rl: RLConfig = RLConfig()
    learner: LearnerConfig = LearnerConfig()
    engine: EngineConfig = EngineConfig()
    proxy: ProxyConfig = ProxyConfig()
    sandbox: SandboxConfig = SandboxConfig()
    harness_mix: HarnessMixConfig = HarnessMixConfig()
    tasks: TasksConfig = TasksConfig()
    fleet: FleetConfig = FleetConfig()
    logging: LoggingConfig = LoggingConfig()
    sft: SupervisedConfig = SupervisedConfig()

    @model_validator(mode="after")
    def _adapter_versions_whole(self) -> Config:
        lora = self.model.lora
        if lora is not None and lora.publish == "adapter" and self.fleet.weights_full_every != 1:
            raise ValueError(
                f"fleet.weights_full_every={self.fleet.weights_full_every} needs model.lora.publish: merged; "
                "adapter versions are published whole (never deltas): set fleet.weights_full_every: 1"
            )
        return self

    @model_validator(mode="after")
    def _schedule_horizon(self) -> Config:
        # Without a horizon of its own, the decay spans the run, whatever total_steps a --set gives it
        # (a fixed horizon shorter than the run would leave the rest of it at a learning rate of 0).
        optimizer = self.learner.optimizer
        if "total_steps" not in optimizer.model_fields_set or optimizer._horizon_from_run:
            optimizer.total_steps = self.total_steps
            optimizer._horizon_from_run = True
        return self


class ConfigError(ValueError):
    """A config that cannot be loaded; the message names file, field and expectation."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value), the value parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected path.to.field=value")
    path = key.strip().split(".")
    if any(not p for p in path):
        raise ConfigError(f"--set {text!r}: empty segment in field path {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML: {exc}") from exc
    return path, value


def _apply(data: dict[str, Any], path: list[str], value: Any, origin: str) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(path[: i + 1])
            raise ConfigError(f"{origin}: {where} is a value, not a section")
        node = child
    node[path[-1]] = value


def _describe(error: ErrorDetails) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field is missing"
    got = error.get("input")
    return f"{error['msg']} (got {got!r})"


def _read_yaml(source: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    """A config file's mapping; with a top-level `base: FILE` (relative to this file), that
    file's mapping with this one's laid over it (mappings merge key by key, anything else replaces)."""
    if not source.is_file():
        raise ConfigError(f"{source}: config file not found")
    try:
        data = yaml.safe_load(source.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{source}: base must be the name of a config file, got {base!r}")
    parent = (source.parent / base).resolve()
    if parent in chain or parent == source.resolve():
        raise ConfigError(f"{source}: base {base} leads back to itself")
    return _laid_over(_read_yaml(parent, (*chain, source.resolve())), data)


def _laid_over(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        below = merged.get(key)
        merged[key] = _laid_over(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return merged


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    default: Path | None = DEFAULT_CONFIG,
) -> Config:
    """Reads YAML (`path`, else `default`; `base: FILE` in it starts from another
    file), applies `--set` overrides, validates. No path and `default=None` start
    from the schema's own defaults (the standalone services)."""
    source = Path(path) if path is not None else default
    data = _read_yaml(source, ()) if source is not None else {}

    origin_of: dict[str, str] = {}
    for text in overrides:
        keys, value = parse_override(text)
        _apply(data, keys, value, f"--set {text}")
        origin_of[".".join(keys)] = f"--set {text}"

    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "<root>"
            origin = next(
                (o for k, o in origin_of.items() if field == k or field.startswith(k + ".")),
                str(source or "schema defaults"),
            )
            lines.append(f"{origin}: {field}: {_describe(err)}")
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def dump_config(config: Config) -> str:
    data = config.model_dump(mode="json")
    if config.learner.optimizer._horizon_from_run:
        del data["learner"]["optimizer"]["total_steps"]
    return yaml.safe_dump(data, sort_keys=False)
