from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrialStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRIAL_STATUS_UNSPECIFIED: _ClassVar[TrialStatus]
    TRIAL_STATUS_OK: _ClassVar[TrialStatus]
    TRIAL_STATUS_ENV_FAILURE: _ClassVar[TrialStatus]
    TRIAL_STATUS_TIMEOUT: _ClassVar[TrialStatus]
    TRIAL_STATUS_HARNESS_ERROR: _ClassVar[TrialStatus]
    TRIAL_STATUS_CAP_EXCEEDED: _ClassVar[TrialStatus]
    TRIAL_STATUS_ENGINE_ERROR: _ClassVar[TrialStatus]
    TRIAL_STATUS_CANCELLED: _ClassVar[TrialStatus]
TRIAL_STATUS_UNSPECIFIED: TrialStatus
TRIAL_STATUS_OK: TrialStatus
TRIAL_STATUS_ENV_FAILURE: TrialStatus
TRIAL_STATUS_TIMEOUT: TrialStatus
TRIAL_STATUS_HARNESS_ERROR: TrialStatus
TRIAL_STATUS_CAP_EXCEEDED: TrialStatus
TRIAL_STATUS_ENGINE_ERROR: TrialStatus
TRIAL_STATUS_CANCELLED: TrialStatus

class RolloutRequest(_message.Message):
    __slots__ = ("request_id", "tasks", "harness_configs", "group_size", "sampling", "policy_version", "limits", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    HARNESS_CONFIGS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tasks: _containers.RepeatedCompositeFieldContainer[TaskRef]
    harness_configs: _containers.RepeatedCompositeFieldContainer[HarnessConfig]
    group_size: int
    sampling: SamplingParams
    policy_version: int
    limits: TrialLimits
    labels: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., tasks: _Optional[_Iterable[_Union[TaskRef, _Mapping]]] = ..., harness_configs: _Optional[_Iterable[_Union[HarnessConfig, _Mapping]]] = ..., group_size: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., policy_version: _Optional[int] = ..., limits: _Optional[_Union[TrialLimits, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TaskRef(_message.Message):
    __slots__ = ("task_id", "location")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    location: str
    def __init__(self, task_id: _Optional[str] = ..., location: _Optional[str] = ...) -> None: ...

class HarnessConfig(_message.Message):
    __slots__ = ("name", "options_json", "config_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    CONFIG_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    options_json: str
    config_id: str
    def __init__(self, name: _Optional[str] = ..., options_json: _Optional[str] = ..., config_id: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ...) -> None: ...

class TrialLimits(_message.Message):
    __slots__ = ("max_model_calls", "max_total_tokens", "agent_timeout_s", "verifier_timeout_s")
    MAX_MODEL_CALLS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AGENT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    max_model_calls: int
    max_total_tokens: int
    agent_timeout_s: float
    verifier_timeout_s: float
    def __init__(self, max_model_calls: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., agent_timeout_s: _Optional[float] = ..., verifier_timeout_s: _Optional[float] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids", "loss_mask", "behavior_logprobs", "policy_version", "side_call", "num_model_calls", "root_reason", "recomputed_tokens", "version_runs", "version_run_lengths", "unreported_version_tokens", "rerendered")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SIDE_CALL_FIELD_NUMBER: _ClassVar[int]
    NUM_MODEL_CALLS_FIELD_NUMBER: _ClassVar[int]
    ROOT_REASON_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERSION_RUNS_FIELD_NUMBER: _ClassVar[int]
    VERSION_RUN_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    UNREPORTED_VERSION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RERENDERED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    behavior_logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_version: int
    side_call: bool
    num_model_calls: int
    root_reason: str
    recomputed_tokens: int
    version_runs: _containers.RepeatedScalarFieldContainer[int]
    version_run_lengths: _containers.RepeatedScalarFieldContainer[int]
    unreported_version_tokens: int
    rerendered: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., behavior_logprobs: _Optional[_Iterable[float]] = ..., policy_version: _Optional[int] = ..., side_call: _Optional[bool] = ..., num_model_calls: _Optional[int] = ..., root_reason: _Optional[str] = ..., recomputed_tokens: _Optional[int] = ..., version_runs: _Optional[_Iterable[int]] = ..., version_run_lengths: _Optional[_Iterable[int]] = ..., unreported_version_tokens: _Optional[int] = ..., rerendered: _Optional[bool] = ...) -> None: ...

class PhaseTimes(_message.Message):
    __slots__ = ("setup_s", "agent_s", "verify_s", "teardown_s")
    SETUP_S_FIELD_NUMBER: _ClassVar[int]
    AGENT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    TEARDOWN_S_FIELD_NUMBER: _ClassVar[int]
    setup_s: float
    agent_s: float
    verify_s: float
    teardown_s: float
    def __init__(self, setup_s: _Optional[float] = ..., agent_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., teardown_s: _Optional[float] = ...) -> None: ...

class TrialMetrics(_message.Message):
    __slots__ = ("model_calls", "tool_calls", "prompt_tokens", "completion_tokens", "phase_times", "history_rewrites", "tool_parse_errors", "verifier_no_reward")
    MODEL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PHASE_TIMES_FIELD_NUMBER: _ClassVar[int]
    HISTORY_REWRITES_FIELD_NUMBER: _ClassVar[int]
    TOOL_PARSE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_NO_REWARD_FIELD_NUMBER: _ClassVar[int]
    model_calls: int
    tool_calls: int
    prompt_tokens: int
    completion_tokens: int
    phase_times: PhaseTimes
    history_rewrites: int
    tool_parse_errors: int
    verifier_no_reward: bool
    def __init__(self, model_calls: _Optional[int] = ..., tool_calls: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., phase_times: _Optional[_Union[PhaseTimes, _Mapping]] = ..., history_rewrites: _Optional[int] = ..., tool_parse_errors: _Optional[int] = ..., verifier_no_reward: _Optional[bool] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("request_id", "task_id", "group_id", "trial_index", "harness", "sequences", "reward", "status", "error", "metrics", "sampling", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TRIAL_INDEX_FIELD_NUMBER: _ClassVar[int]
    HARNESS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    task_id: str
    group_id: str
    trial_index: int
    harness: HarnessConfig
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    reward: float
    status: TrialStatus
    error: str
    metrics: TrialMetrics
    sampling: SamplingParams
    labels: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., trial_index: _Optional[int] = ..., harness: _Optional[_Union[HarnessConfig, _Mapping]] = ..., sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., reward: _Optional[float] = ..., status: _Optional[_Union[TrialStatus, str]] = ..., error: _Optional[str] = ..., metrics: _Optional[_Union[TrialMetrics, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("version", "location")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    version: int
    location: str
    def __init__(self, version: _Optional[int] = ..., location: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("loaded_version", "reload_s", "probe_max_abs_diff", "update_path")
    LOADED_VERSION_FIELD_NUMBER: _ClassVar[int]
    RELOAD_S_FIELD_NUMBER: _ClassVar[int]
    PROBE_MAX_ABS_DIFF_FIELD_NUMBER: _ClassVar[int]
    UPDATE_PATH_FIELD_NUMBER: _ClassVar[int]
    loaded_version: int
    reload_s: float
    probe_max_abs_diff: float
    update_path: str
    def __init__(self, loaded_version: _Optional[int] = ..., reload_s: _Optional[float] = ..., probe_max_abs_diff: _Optional[float] = ..., update_path: _Optional[str] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("header", "tensor", "delta")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    header: WeightHeader
    tensor: TensorChunk
    delta: bytes
    def __init__(self, header: _Optional[_Union[WeightHeader, _Mapping]] = ..., tensor: _Optional[_Union[TensorChunk, _Mapping]] = ..., delta: _Optional[bytes] = ...) -> None: ...

class WeightHeader(_message.Message):
    __slots__ = ("version", "files", "delta", "relay_to")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    RELAY_TO_FIELD_NUMBER: _ClassVar[int]
    version: int
    files: _containers.ScalarMap[str, bytes]
    delta: bool
    relay_to: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., files: _Optional[_Mapping[str, bytes]] = ..., delta: _Optional[bool] = ..., relay_to: _Optional[_Iterable[str]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStatus(_message.Message):
    __slots__ = ("capacity", "in_flight_trials", "queued_trials", "loaded_policy_version", "engine_healthy", "server_version", "harnesses", "draining")
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_TRIALS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TRIALS_FIELD_NUMBER: _ClassVar[int]
    LOADED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    HARNESSES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    capacity: int
    in_flight_trials: int
    queued_trials: int
    loaded_policy_version: int
    engine_healthy: bool
    server_version: str
    harnesses: _containers.RepeatedScalarFieldContainer[str]
    draining: bool
    def __init__(self, capacity: _Optional[int] = ..., in_flight_trials: _Optional[int] = ..., queued_trials: _Optional[int] = ..., loaded_policy_version: _Optional[int] = ..., engine_healthy: _Optional[bool] = ..., server_version: _Optional[str] = ..., harnesses: _Optional[_Iterable[str]] = ..., draining: _Optional[bool] = ...) -> None: ...
