"""What a policy sees: the private KV slots of one layer for every row of the
batch that runs the policy, and the observations the attention pass produced.

Shapes: R = rows (requests) of the policy in this step, H = kv heads,
S = slots per head (page-table columns x page_size, the same for every row
and head of the step; free slots have valid False), Hq = query heads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


class Need(enum.Flag):
    """Observations a policy asks the attention pass to produce."""

    NONE = 0
    ATTENTION = enum.auto()  # probability mass per slot, summed over the kv head's query group
    PV_NORM = enum.auto()  # ||p * v||_1 per slot, summed over the query group (LongFlow)
    SPARSITY = enum.auto()  # per query head: share of probabilities < 1% of the row max
    HIDDEN_STATES = enum.auto()  # last layer's hidden state of the new token
    TOKEN_IDS = enum.auto()
    KEYS = enum.auto()  # SlotView.keys: the slots' post-RoPE keys (ThinKV's k-means)
    #: The first layer's attention over the private prompt, summarized per
    #: 1024-query chunk at the prompt's end (radix_ext/layer0_probe.py):
    #: Policy.prompt_attention_inputs gets it (CrystalCache S1).
    LAYER0_ATTENTION = enum.auto()
    LAYER0_KEYS = enum.auto()  # SlotView.keys in the first layer's decisions only
    #: SlotView.queries: each row's post-RoPE queries of its last QUERY_WINDOW
    #: decode steps in the layer, kept by the engine per req_pool row
    #: (radix_ext/query_ring.py; R-KV's observation window).
    QUERIES = enum.auto()


#: Decode queries the engine keeps per (req_pool row, layer) for Need.QUERIES:
#: R-KV's observation window (alpha = 8).
QUERY_WINDOW = 8


@dataclass
class PromptAttention:
    """What Need.LAYER0_ATTENTION hands a policy at the end of a request's
    private prompt: the first layer's attention probabilities (the private
    columns of the joint softmax over prefix + prompt) of every private
    prompt query, summarized per chunk of `chunk` queries, on the device.
    Local index i is the private prompt's i-th token (absolute position
    base + i). Query heads: Hq; rows without an edge pad with index -1."""

    state: object  # the request's RequestState
    token_ids: list  # [n] the private prompt's token ids
    base: int  # absolute position of local index 0
    budget: int  # the request's budget at the prompt's end (tokens per layer and kv head)
    chunk: int
    #: [n] per key i: the attention it receives from its own chunk's queries,
    #: summed over those queries per head, then over the top `top_heads` heads.
    saliency: torch.Tensor
    #: [n, k] per query i of a chunk: the k other queries of its chunk whose
    #: head-mean attention rows (over the chunk's keys) are most cosine-similar.
    intra_index: torch.Tensor
    intra_weight: torch.Tensor
    #: [n, k] per query i: the k keys before its chunk with the highest
    #: head-mean attention probability.
    cross_index: torch.Tensor
    cross_weight: torch.Tensor


@dataclass
class SlotView:
    """The rows' slots in one layer. `score` and `last_hit` are per-slot
    policy state kept in the region between steps; a policy with
    keeps_slot_state may update them in place. Free slots have valid False
    and position -1."""

    valid: torch.Tensor  # [R, H, S] bool
    position: torch.Tensor  # [R, H, S] int64, token position (-1: free)
    #: [R, H, S] float32 and int32; None for a policy without keeps_slot_state
    #: (the backend then does not gather them).
    score: Optional[torch.Tensor]
    last_hit: Optional[torch.Tensor]
    #: [R, H, S, D] post-RoPE keys, given only to policies that need Need.KEYS.
    keys: Optional[torch.Tensor] = None
    #: Need.QUERIES, deciding rows only: [R, QUERY_WINDOW, Hq, D] the rows'
    #: latest decode queries of this layer (post-RoPE, in ring order) and
    #: [R, QUERY_WINDOW] the position of each one's token (-1: none yet).
    #: A slot may still hold a query of the row's previous request: its
    #: position tells (policies.skipkv.rkv_paper.own_recent_queries).
    queries: Optional[torch.Tensor] = None
    query_position: Optional[torch.Tensor] = None

    @property
    def held(self) -> torch.Tensor:
        """Retained tokens per (row, head), [R, H]."""
        return self.valid.sum(dim=-1)


@dataclass
class Observations:
    """Produced in the same pass as attention, only where a policy asked."""

    attention: Optional[torch.Tensor] = None  # [R, H, S] float32
    pv_norm: Optional[torch.Tensor] = None  # [R, H, S] float32
    sparsity: Optional[torch.Tensor] = None  # [R, Hq] float32

    def rows(self, index: torch.Tensor) -> "Observations":
        """The observations of a subset of rows."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return Observations(pick(self.attention), pick(self.pv_norm), pick(self.sparsity))


@dataclass(frozen=True)
class HeadShards:
    """This process's share of a layer's kv heads. Under tensor parallelism
    each rank holds H/size of them; a decision that combines heads (a
    layer-wide score, a per-layer sparsity, a budget moved between heads)
    must reduce over every rank's heads, or the ranks keep different tokens.
    The engine fills the collectives (radix_ext/head_parallel.py); with one
    rank every method is the identity. Every rank calls them in the same
    order with tensors of the same shape."""

    size: int = 1
    rank: int = 0
    all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # sum over ranks
    all_gather: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None  # concatenate along a dim

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks of a tensor already summed over local heads."""
        return x if self.size == 1 else self.all_reduce(self._outside_capture(x))

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """Mean over the ranks of a mean over local heads (ranks hold equal head counts)."""
        return x if self.size == 1 else self.all_reduce(self._outside_capture(x)) / self.size

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's heads, concatenated along `dim` in rank order."""
        return x if self.size == 1 else self.all_gather(self._outside_capture(x), dim)

    @staticmethod
    def _outside_capture(x: torch.Tensor) -> torch.Tensor:
        # A policy that reduces over heads must say so (Policy.crosses_heads):
        # its pass then runs eagerly under TP, never inside a captured graph.
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a collective over heads inside a captured graph: set the policy's crosses_heads")
        return x.contiguous()

    def local(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of an all-heads tensor along `dim`."""
        return x if self.size == 1 else x.chunk(self.size, dim=dim)[self.rank]


#: One rank: no collectives.
LOCAL_HEADS = HeadShards()


@dataclass
class PolicyBatch:
    """Per-row inputs of one batched decision, as tensors on the region's
    device: the budget per (row, head) of this layer, the decode step of
    each row (tokens generated before this one), and every numeric policy
    parameter as an [R] tensor (`param("sinks")`), with its largest value
    over the rows known on the host (`max_param`), for loops bounded by a
    parameter. `inputs` carries what Policy.step_inputs built for this
    step."""

    layer: int
    budget: torch.Tensor  # [R, H] int64
    step: torch.Tensor  # [R] int64
    params: dict = field(default_factory=dict)  # name -> [R] tensor
    maxima: dict = field(default_factory=dict)  # name -> int or float
    #: Per-step dynamic inputs from Policy.step_inputs (name -> [R, ...] tensor).
    inputs: dict = field(default_factory=dict)
    #: req_pool row of each request [R] (stable for its life), to index
    #: per-request device buffers a policy keeps, sized by max_rows.
    pool_rows: Optional[torch.Tensor] = None
    max_rows: int = 0
    #: This rank's share of the kv heads (tensor parallelism): reduce over
    #: it whatever a decision combines across heads.
    heads: HeadShards = LOCAL_HEADS
    #: A pass over several layers stacked as rows (radix_ext/layer_blocks.py,
    #: Policy.decides_layers_apart): each row's layer [R] on the device and
    #: the layers on the host, in order; None: every row is in `layer`.
    layers: Optional[torch.Tensor] = None
    layer_ids: Optional[list] = None

    def row_layers(self):
        """Each row's layer: the [R] tensor of a stacked pass, else `layer`
        (either indexes a per-(row, layer) buffer as buffer[pool_rows, it])."""
        return self.layer if self.layers is None else self.layers

    def param(self, name: str) -> torch.Tensor:
        return self.params[name]

    def max_param(self, name: str):
        return self.maxima[name]


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list as a tensor on `device` without a host-device sync: on
    CUDA through pinned memory and an asynchronous copy, ordered on the
    current stream like every later use (a plain copy would block the host)."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def rows_to_device(lists: list, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Several host lists as tensors on `device` in one transfer (to_device
    of their concatenation, split into views): a step's per-group lists
    went one copy each, dozens a step in a mixed batch."""
    if not lists:
        return []
    flat = to_device([v for values in lists for v in values], dtype, device)
    return list(flat.split([len(values) for values in lists]))


def rank_by_position(view: SlotView, newest_first: bool) -> torch.Tensor:
    """Rank of each valid slot among its (row, head)'s valid slots by position
    (0 = oldest, or newest with newest_first); invalid slots rank last.
    Same shape as view.valid."""
    big = torch.iinfo(torch.int64).max // 4
    key = -view.position if newest_first else view.position
    key = torch.where(view.valid, key, torch.full_like(key, big))
    return ranks_of(key, descending=False)


#: Up to this many newest slots are found by a top-k over positions rather
#: than by ranking every slot (a full sort per (row, head) and layer: on an
#: H100 at 512 rows x 1K slots the sorts were 9 ms of a 64 ms step).
SMALL_K = 64


def newest_mask(valid: torch.Tensor, position: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Valid slots among the k newest by position of their (row, head):
    rank_by_position(newest_first=True) < k on valid slots. valid/position
    [..., S]; k broadcastable to valid.shape[:-1]; k_max (host) bounds k.
    Positions of valid slots are distinct within a (row, head), so the
    result does not depend on tie order."""
    k = k.expand(valid.shape[:-1])
    key = torch.where(valid, position, torch.full_like(position, -1))
    if k_max <= 0:
        return torch.zeros_like(valid)
    if k_max == 1:
        return valid & (key == key.amax(dim=-1, keepdim=True)) & (k >= 1).unsqueeze(-1)
    if k_max > SMALL_K or k_max >= valid.shape[-1]:
        return valid & (ranks_of(torch.where(valid, -position, torch.full_like(position, 1 << 60)),
                                 descending=False) < k.unsqueeze(-1))
    top = key.topk(k_max, dim=-1).indices  # newest first
    chosen = torch.arange(k_max, device=valid.device) < k.unsqueeze(-1)
    return torch.zeros_like(valid).scatter_(-1, top, chosen) & valid


def ranks_of(key: torch.Tensor, descending: bool) -> torch.Tensor:
    """Rank of each entry along the last dim (stable: ties by lower index)."""
    order = key.argsort(dim=-1, descending=descending, stable=True)
    ranks = torch.empty_like(order)
    arange = torch.arange(order.shape[-1], device=order.device)
    ranks.scatter_(-1, order, arange.expand_as(order))
    return ranks


def keep_top_k(values: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per (row, head), the k eligible entries of highest value (ties: lower
    slot). values/eligible [..., S]; k broadcastable to values.shape[:-1]."""
    masked = torch.where(eligible, values.float(), torch.full_like(values, float("-inf"), dtype=torch.float32))
    return eligible & (ranks_of(masked, descending=True) < k.unsqueeze(-1))
