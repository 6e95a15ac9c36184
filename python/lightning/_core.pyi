"""Type stubs for the private native module. Use the names re-exported by `lightning`."""

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, final

import numpy as np
import numpy.typing as npt

__version__: str

class LightningError(Exception):
    """Root of all lightning errors."""

class InvalidCallError(LightningError, ValueError):
    """A call's data cannot be merged (bad ids, lengths that disagree, ...). A ValueError."""

# --- merge (trace types and the radix-trie merge) ---

_IdsIn = npt.ArrayLike | Sequence[int]

@final
class Call:
    """One model call of a rollout: exact prompt ids, completion ids and rollout logprobs.

    Ids accept lists or numpy integer arrays and are stored as uint32 numpy arrays
    (a C-contiguous uint32 array is kept as is, without copying, like ``np.asarray``);
    logprobs are stored as float32. Raises ``InvalidCallError`` (a ``ValueError``) for
    ids that are not integers or are outside the uint32 range.
    """

    def __new__(
        cls,
        rollout_id: str,
        prompt_ids: _IdsIn,
        completion_ids: _IdsIn,
        logprobs: npt.ArrayLike | Sequence[float] | None = None,
        finish_reason: str | None = None,
        weight_version: int = 0,
        group: str | None = None,
    ) -> Call: ...
    @property
    def rollout_id(self) -> str:
        """The rollout this call belongs to."""
    @property
    def prompt_ids(self) -> npt.NDArray[np.uint32]:
        """Prompt token ids (uint32)."""
    @property
    def completion_ids(self) -> npt.NDArray[np.uint32]:
        """Completion token ids (uint32)."""
    @property
    def logprobs(self) -> npt.NDArray[np.float32] | None:
        """Rollout logprob per completion token (float32), or None."""
    @property
    def finish_reason(self) -> str | None:
        """Why generation stopped ("stop", "length", ...), if known."""
    @property
    def weight_version(self) -> int:
        """Version of the policy weights that served the call."""
    @property
    def group(self) -> str | None:
        """The GRPO group (rollouts of one task), or None."""

@final
class Sample:
    """One training sequence: a root-to-leaf path of a rollout's trie.

    ``weights`` is the number of calls that generated each token in the one sample
    where it is trained (0 for context); ``logprobs`` is the rollout logprob wherever
    some call generated the token (NaN otherwise); ``call_index`` is the first
    generating call's index in the ``merge_calls`` input where the weight is > 0,
    else -1. The arrays are views into one flat buffer per field shared by all
    samples of the merge (writable; each access returns a new view of the same memory).
    """

    @property
    def rollout_id(self) -> str:
        """The rollout this sample comes from."""
    @property
    def group(self) -> str | None:
        """The rollout's GRPO group, or None."""
    @property
    def rollout_index(self) -> int:
        """Index of this sample's rollout in ``MergeResult.rollouts``."""
    @property
    def tokens(self) -> npt.NDArray[np.uint32]:
        """Token ids (uint32)."""
    @property
    def weights(self) -> npt.NDArray[np.float32]:
        """Loss weight per token (float32): number of generating calls, 0 for context."""
    @property
    def logprobs(self) -> npt.NDArray[np.float32]:
        """Rollout logprob per token (float32, NaN where unknown)."""
    @property
    def call_index(self) -> npt.NDArray[np.int32]:
        """Generating call per token (int32 index into the input, -1 for context)."""
    @property
    def weight_version(self) -> npt.NDArray[np.int64]:
        """Weight version of the call that generated each token (int64, -1 for context)."""
    @property
    def truncated(self) -> int:
        """Generated tokens (summed weights) this sample lost to ``max_tokens``."""
    def __len__(self) -> int: ...

@final
class Divergence:
    """A point where a call's prompt departs from a path an earlier call of the same rollout produced.

    ``position`` is the first differing token's depth, ``left_call_index`` the latest
    earlier call whose path continued there. ``kind`` is "unclassified" without a
    tokenizer, else the cause ``classify_drift`` names: "retokenization",
    "reasoning_stripped", "tool_call_reserialized", "truncated", "separator",
    "compacted" or "other".
    """

    @property
    def rollout_id(self) -> str: ...
    @property
    def call_index(self) -> int: ...
    @property
    def position(self) -> int: ...
    @property
    def left_call_index(self) -> int: ...
    @property
    def kind(self) -> str: ...

@final
class RolloutInfo:
    """A rollout of a merge: its group and, when read from the store, mode, status and latest reward.

    None where unknown (calls merged without rollout records, a rollout nobody rewarded).
    """

    def __new__(
        cls,
        rollout_id: str,
        group: str | None = None,
        mode: str | None = None,
        status: str | None = None,
        reward: float | None = None,
    ) -> RolloutInfo: ...
    @property
    def rollout_id(self) -> str: ...
    @property
    def group(self) -> str | None: ...
    @property
    def mode(self) -> str | None: ...
    @property
    def status(self) -> str | None: ...
    @property
    def reward(self) -> float | None: ...

@final
class MergeStats:
    """Counts describing one merge.

    ``generated_tokens`` sums completion lengths; ``sample_tokens`` sums sample
    lengths; ``truncated_tokens`` counts generated tokens (per generating call) cut by
    ``max_tokens``; ``dropped_samples`` counts samples that truncation left with
    nothing to train; ``duplicates`` counts calls whose full sequence repeats an
    earlier call's in the same rollout; ``skipped_calls`` counts stored calls a
    store read left out as untrainable.
    """

    @property
    def calls(self) -> int: ...
    @property
    def rollouts(self) -> int: ...
    @property
    def samples(self) -> int: ...
    @property
    def generated_tokens(self) -> int: ...
    @property
    def sample_tokens(self) -> int: ...
    @property
    def truncated_tokens(self) -> int: ...
    @property
    def dropped_samples(self) -> int: ...
    @property
    def duplicates(self) -> int: ...
    @property
    def skipped_calls(self) -> int: ...
    def as_dict(self) -> dict[str, int]:
        """The counts as a plain dict."""

@final
class PackedTree:
    """Every trie node (one per token) in DFS order, for one forward pass with an ancestor mask.

    ``parent`` is -1 at roots; ``depth`` is the position id; ``weights`` counts
    generating calls; ``gen_offsets``/``gen_call`` list the generating calls per token
    (CSR); ``tree_offsets``/``tree_keys`` delimit the trees. Per token, ``rollout``,
    ``group`` and ``weight_version`` come from the first generating call (-1 for
    context; ``group`` is the tree's for every token); ``call_rollout`` maps every
    input call to its rollout, so a token several rollouts generated credits each.
    """

    @property
    def tokens(self) -> npt.NDArray[np.uint32]:
        """Token ids in DFS order (uint32)."""
    @property
    def parent(self) -> npt.NDArray[np.int64]:
        """Index of each token's parent (int64, -1 at a root)."""
    @property
    def depth(self) -> npt.NDArray[np.int64]:
        """Position id of each token (int64)."""
    @property
    def weights(self) -> npt.NDArray[np.float32]:
        """Number of calls that generated each token (float32, 0 for context)."""
    @property
    def logprobs(self) -> npt.NDArray[np.float32]:
        """Rollout logprob of each token (float32, NaN where unknown)."""
    @property
    def gen_offsets(self) -> npt.NDArray[np.int64]:
        """CSR offsets into ``gen_call`` (int64, length len(tokens) + 1)."""
    @property
    def gen_call(self) -> npt.NDArray[np.int32]:
        """Generating call indices (int32), in input order per token."""
    @property
    def tree_offsets(self) -> npt.NDArray[np.int64]:
        """Start of each tree (int64, length len(tree_keys) + 1)."""
    @property
    def tree_keys(self) -> list[str]:
        """Rollout id (or group name, when packed across rollouts) of each tree."""
    def locate(self, tokens: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """The node of each position of a token sequence (int64), walking from a root.

        Raises ``InvalidCallError`` naming the position where the sequence leaves the tree.
        """
    @property
    def rollout(self) -> npt.NDArray[np.int32]:
        """Rollout of each token's first generator (int32 index into ``rollout_ids``, -1 for context)."""
    @property
    def group(self) -> npt.NDArray[np.int32]:
        """Group of each token's tree (int32 index into ``groups``, -1 without a group)."""
    @property
    def weight_version(self) -> npt.NDArray[np.int64]:
        """Weight version of each token's first generator (int64, -1 for context)."""
    @property
    def call_rollout(self) -> npt.NDArray[np.int32]:
        """Rollout of every input call (int32 index into ``rollout_ids``)."""
    @property
    def rollout_ids(self) -> list[str]:
        """The merge's rollouts, as in ``MergeResult.rollouts``."""
    @property
    def groups(self) -> list[str]:
        """The merge's distinct groups, in order of first appearance."""
    def __len__(self) -> int: ...

@final
class MergeResult:
    """The result of ``merge_calls`` or a store read: samples, divergences, stats,
    rollouts, and the packed tree on demand."""

    @property
    def samples(self) -> list[Sample]:
        """Training samples; rollouts in order of first appearance, each in DFS order of its trie.

        Written from the merge's tries on first access (GIL released), so a consumer
        of ``packed()`` or ``stats`` alone never pays for them.
        """
    @property
    def divergences(self) -> list[Divergence]:
        """Where a later call's prompt left an earlier call's path."""
    @property
    def stats(self) -> MergeStats:
        """Counts describing the merge."""
    @property
    def calls(self) -> list[Call]:
        """The merged calls, in input order (what ``call_index`` and ``gen_call`` index)."""
    @property
    def rollouts(self) -> list[RolloutInfo]:
        """Every rollout of the merge: those passed in (or read from the store), including
        rollouts without trainable calls, then any other rollout of the calls."""
    def packed(self, across_rollouts: bool = False) -> PackedTree:
        """The packed-tree form of the same calls (same ``max_tokens``).

        One tree per rollout; with ``across_rollouts=True`` one tree per ``group``
        (calls whose group is None stay in their rollout's tree), so a group's shared
        prompt appears once and ``gen_call`` says which call generated each token.
        """

def merge_calls(
    calls: Iterable[Call],
    max_tokens: int | None = None,
    *,
    tokenizer: Tokenizer | None = None,
    rollouts: Sequence[RolloutInfo] | None = None,
) -> MergeResult:
    """Merge calls into training samples with a radix trie per rollout.

    Calls are grouped by ``rollout_id``, input order kept within a rollout; the GIL
    is released while merging. ``max_tokens`` cuts samples and reports what it cut.
    With a ``tokenizer`` every divergence's cause is classified (``classify_drift``);
    without one every kind is "unclassified". ``rollouts`` lists the rollouts (group,
    mode, status, reward) in the order ``MergeResult.rollouts`` keeps. Raises
    ``InvalidCallError`` (a ``ValueError``) naming the call index for an empty
    completion, logprobs whose length differs from the completion's, or calls of one
    rollout that disagree on ``group`` (with each other or their rollout record).
    """

def release_merge_buffers() -> int:
    """Free the arrays that dropped merge results left for reuse; returns the bytes
    released.

    A ``MergeResult``'s samples and ``PackedTree`` arrays are written into arrays of
    results the process no longer holds (at most 32 arrays, about two results'
    worth; one is reused only for a result of at least half its size), so each
    training step's batch is written into memory that is already faulted in.
    Results still alive keep theirs. Call this when a process is done merging and
    wants that memory back."""

def _common_prefix_u32(a: npt.NDArray[np.uint32], b: npt.NDArray[np.uint32]) -> int:
    """Common-prefix length with the merge's compare loop (for benches/merge.py)."""

def _common_prefix_pairs_u32(
    a: Sequence[npt.NDArray[np.uint32]], b: Sequence[npt.NDArray[np.uint32]]
) -> tuple[int, float]:
    """Sum of the common-prefix lengths of ``a[i]`` and ``b[i]`` and the seconds the
    compares took, on one thread (for benches/merge.py's read floor)."""

# --- gateway ---

class GatewayError(LightningError):
    """The gateway could not start or run (bad config, port in use, store failure)."""

class GatewayConfigError(GatewayError, ValueError):
    """The gateway configuration is invalid (the message names the field). A ValueError."""

class GatewayBindError(GatewayError, OSError):
    """The gateway cannot listen on its address (port in use, no permission). An OSError."""

class StoreError(GatewayError):
    """The trace store cannot be opened or read (the message names the file)."""

@final
class StoreReader:
    """A read-only connection to a gateway's store file. Used by ``lightning.Store``."""

    def __new__(cls, path: str | os.PathLike[str]) -> StoreReader: ...
    def rollouts(
        self,
        rollout_ids: Sequence[str] | None = None,
        *,
        group: str | None = None,
        status: str | None = None,
        mode: str | None = None,
        after: str | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]: ...
    def rollout_counts(self) -> list[tuple[str, str, int]]: ...
    def call_rate(self, *, window_s: float = 600.0, bucket_s: float = 5.0) -> dict[str, Any]: ...
    def session_page(
        self,
        *,
        after: str | None = None,
        limit: int = 50,
        key: str | None = None,
        tag: str | None = None,
        feedback: bool | None = None,
        trained: bool | None = None,
    ) -> list[dict[str, Any]]: ...
    def records(self, rollout_id: str) -> list[dict[str, Any]]: ...
    def events(self, rollout_id: str) -> list[tuple[int, str, str, float]]: ...
    def sessions(
        self, *, since: float | None = None, until: float | None = None
    ) -> list[dict[str, Any]]: ...
    def feedback(self, rollout_id: str) -> list[dict[str, Any]]: ...
    def call_bodies(
        self, rollout_id: str
    ) -> list[tuple[int, str | None, str | None, str | None]]: ...
    def requests(self, rollout_id: str) -> list[tuple[int, str, str | None]]:
        """Each call's ``(seq, engine_request, harness_request)`` in seq order, whole."""
    def trace(self, rollout_id: str) -> list[Call]: ...
    def read_step(
        self,
        rollout_ids: Sequence[str] | None = None,
        *,
        group: str | None = None,
        status: str | None = None,
        mode: str | None = None,
        max_tokens: int | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> MergeResult: ...

def mark_trained(path: str | os.PathLike[str], rollout_ids: Sequence[str], when: float) -> int: ...
def check_writable(path: str | os.PathLike[str]) -> None: ...
def store_open_here(path: str | os.PathLike[str]) -> bool: ...

@final
class GatewayHandle:
    @property
    def url(self) -> str: ...
    @property
    def running(self) -> bool: ...
    def stop(self) -> None: ...

def gateway_start(config_json: str, threads: int = 2) -> GatewayHandle: ...
def gateway_config_schema() -> str:
    """The Rust gateway config as JSON: ``fields`` (name, python_type, default, doc, bound),
    ``defaults``, ``upstream_defaults``, ``engines``, ``sync_modes``."""

def gateway_serve(config_json: str, threads: int = 2) -> None: ...
def gateway_main(argv: list[str]) -> int: ...

# --- tokenizer ---

_TokIds = npt.NDArray[np.uint32]
_IdsLike = npt.ArrayLike
_Messages = Sequence[Mapping[str, Any]]

class TemplateError(LightningError):
    """A chat template failed to compile or raised (the template's own message)."""

class TokenizerError(LightningError):
    """A tokenizer could not be loaded (bad JSON names the path) or failed to encode/decode."""

@final
class MessageSpan:
    @property
    def index(self) -> int: ...
    @property
    def role(self) -> str: ...
    @property
    def byte_start(self) -> int: ...
    @property
    def byte_end(self) -> int: ...
    @property
    def token_start(self) -> int: ...
    @property
    def token_end(self) -> int: ...

@final
class SplicedSpan:
    @property
    def generation(self) -> int: ...
    @property
    def byte_start(self) -> int: ...
    @property
    def byte_end(self) -> int: ...
    @property
    def token_start(self) -> int: ...
    @property
    def token_end(self) -> int: ...
    @property
    def plain_differs(self) -> bool: ...

@final
class SpliceResult:
    @property
    def ids(self) -> _TokIds: ...
    @property
    def text(self) -> str: ...
    @property
    def spliced(self) -> list[SplicedSpan]: ...
    @property
    def unmatched(self) -> list[int]: ...
    @property
    def prevented(self) -> int: ...

@final
class Drift:
    @property
    def kind(self) -> str: ...
    @property
    def position(self) -> int: ...
    @property
    def text_offset(self) -> int: ...
    @property
    def detail(self) -> str: ...

@final
class Tokenizer:
    @staticmethod
    def from_file(path: str | os.PathLike[str], chat_template: str | None = None) -> Tokenizer: ...
    @staticmethod
    def from_dir(path: str | os.PathLike[str], chat_template: str | None = None) -> Tokenizer: ...
    @property
    def chat_template(self) -> str | None: ...
    @property
    def bos_token(self) -> str | None: ...
    @property
    def eos_token(self) -> str | None: ...
    @property
    def segment_safe(self) -> bool: ...
    @property
    def word_path(self) -> bool: ...
    @property
    def vocab_size(self) -> int: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, id: int) -> str | None: ...
    def is_special(self, id: int) -> bool: ...
    def encode(self, text: str, add_special_tokens: bool = False) -> _TokIds: ...
    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[_TokIds]: ...
    def decode(self, ids: _IdsLike, skip_special_tokens: bool = False) -> str: ...
    def render_chat(
        self,
        messages: _Messages,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str: ...
    def encode_chat(
        self,
        messages: _Messages,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        protect_content: bool = False,
        **kwargs: Any,
    ) -> _TokIds: ...
    def chat_spans(
        self,
        messages: _Messages,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> list[MessageSpan]: ...
    def splice(
        self,
        messages: _Messages,
        generations: Sequence[Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        protect_content: bool = True,
        **kwargs: Any,
    ) -> SpliceResult: ...
    def count_control_tokens(self, text: str) -> int: ...
    def content_control_tokens(self, messages: _Messages) -> int: ...
    def clear_cache(self) -> None: ...

def classify_drift(prev_ids: _IdsLike, next_ids: _IdsLike, tokenizer: Tokenizer) -> Drift: ...
def pack_sequences(sequences: Iterable[npt.ArrayLike]) -> PackedTree:
    """The packed tree of plain token sequences: one forest, every shared prefix once.

    Empty sequences are skipped; the GIL is released while packing.
    """
