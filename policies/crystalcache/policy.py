"""`crystalcache` (CrystalCache, crystalcache.txt §3, Table 2; policies.md):
one index set per request (every layer and head keeps the same positions),
chosen over trunks (sentence groups).

Prefill (S1-S6, specified by policies.crystalcache.prefill): at the end of
the private prompt the engine probes the first layer's attention chunk by
chunk (Need.LAYER0_ATTENTION, radix_ext/layer0_probe.py) and hands the
summary (saliency, intra- and cross-chunk edge candidates) to
`prompt_attention_inputs` on the device, which runs S1-S6 for every ending
prompt at once (prefill_batched.prefill_rows: edges, trunks, M_i, D, branch
dissolution down to B = max(floor, budget)) with no read-back; the kept
positions reach every layer's select_prefill as a keep table
(policies.crystalcache.select), and the trunk table starts its copy to the
host there, adopted by a later step once landed (_adopt_prefills).

Decode (policies.crystalcache.decode / trunks): decoded tokens start their
way to the host where they are made (on_forward_tokens: one gather and one
HostCopy per forward, policies/host_reads.py) and join the trunk table at
each breath cycle. Every `breath` steps (64), the only steps whose decision
is due (deciding_rows; observe_decode accumulates the first layer's
attention in between):
  * at step s = k*breath - 1 the first layer's decision snapshots, for the
    rows due, its slots' positions, the layer-0 attention they received
    since the last snapshot (accumulated in view.score, first layer only)
    and the layer-0 key norms (Need.LAYER0_KEYS), and starts their copy to
    the host;
  * at step s + 2 (two of the request's own forwards later: on a GPU the
    snapshot's forward has ended while the host prepares that step, so
    nothing waits, and SGLang's overlap scheduler keeps the GPU busy with
    step s + 1 during the cycle's host work), step_inputs takes the
    snapshot and the tokens of the forwards up to s, applies the steps of
    D decay since the last cycle (every cycling request in one tensor
    loop), gives the tokens their received attention (pending sentences),
    adds them (closing sentences into trunks), and runs the breath cycle
    (activation, resonance, Hebbian, re-eviction to B); the keep table goes
    to every layer's select_decode of that step. Positions the snapshot had
    not seen (the tokens of steps s + 1 and s + 2) are kept.
Between breath cycles nothing is evicted: the decode decision is a no-op
apart from the first layer's attention accumulation.

Decisions (beyond policies.md):
  * B = max(floor, budget), floor = max(sinks + recent, sinks + 2 (t_max - 1)):
    the paper's 4 + 128, and room for the decode phase's protected sink trunk
    (<= sinks + t_max - 1 tokens) plus an unfinished sentence (<= t_max - 1
    tokens), so a breath cycle can always get down to B (sinks + 62 at the
    default t_max 32). A fixed budget below the floor
    is refused (400, kv_policy.budget).
  * `sinks` counts from the first private token (with compress_prompt off,
    the first generated one); the shared prefix is never evicted anyway.
  * A decoded token's saliency: the layer-0 attention it received (summed
    over kv heads, scaled by 3 / query heads: the mean head times the
    paper's top-3 heads), from its own query on, until the breath cycle
    that closes its sentence.
  * T_max, tau_merge and alpha (Table 2; §8 L6: the knobs to tune per
    task) are per-request params t_max, tau_merge, alpha: prefill_rows takes
    them per row (tensors; its merge loop runs the batch's largest t_max
    steps, a no-op past a row's own), the decode trunk table keeps the
    request's t_max (longest unfinished sentence) and alpha (re-eviction).
  * D decays every step; applied in bulk at each breath cycle (exact for
    the trunks that existed during the cycle; a trunk born in a cycle
    starts decaying at the next one).
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch
from pydantic import Field

from ..base import Policy, PolicyParams, RequestState
from .decode import decay_rows
from .prefill import ALPHA, T_MAX, TAU_CROSS, TAU_INTRA, TAU_MERGE, TOP_HEADS, Dissolution, PrefillResult
from .prefill_batched import prefill_rows
from .select import evict_outside, keep_table, keep_width
from .snapshot import PositionTable, position_tables
from .trunks import CrystalTrunks
from ..host_reads import HostCopy
from ..observations import Need, PromptAttention, to_device
from ..registry import register_policy


class CrystalCacheParams(PolicyParams):
    sinks: int = Field(default=4, ge=0, le=4096,
                       description="first private tokens whose trunks are never evicted (prefill and decode)")
    recent: int = Field(default=128, ge=0, le=1 << 20,
                        description="last prompt tokens whose trunks the prefill selection protects")
    breath: int = Field(default=64, ge=1, le=1 << 16,
                        description="decode steps between breath cycles (activation, resonance, Hebbian, re-eviction)")
    decode: bool = Field(default=True, description="run the decode phase (false: prefill selection only)")
    # The per-task knobs of crystalcache.txt §8 L6 (Table 2 defaults).
    t_max: int = Field(default=T_MAX, ge=1, le=256,
                       description="T_max: the largest trunk, in tokens (S2, §3.3; decode: the longest unfinished "
                                   "sentence). The budget floor grows with it: sinks + 2 * (t_max - 1)")
    tau_merge: float = Field(default=TAU_MERGE, ge=0.0, le=1.0, allow_inf_nan=False,
                             description="tau_merge: adjacent sentences merge into one trunk while their interface "
                                         "co-attention strength (CAS) exceeds it (S2, §3.3; 1: never merge)")
    alpha: float = Field(default=ALPHA, ge=0.0, le=16.0, allow_inf_nan=False,
                         description="alpha: weight of the M_i path in score = max(D, alpha * normalized log(1 + M̄)) "
                                     "(S5, §3.6; also the decode re-eviction; 0: D only)")


def budget_floor(params: CrystalCacheParams) -> int:
    """Smallest B: the protected prompt ends, and a decode cycle's protected
    sink trunk plus an unfinished sentence."""
    return max(params.sinks + params.recent, params.sinks + 2 * (params.t_max - 1))


def effective_budget(params: CrystalCacheParams, budget: int) -> int:
    return max(budget_floor(params), budget)


class CrystalCacheState(RequestState):
    def __init__(self, params, num_layers, num_kv_heads):
        super().__init__(params, num_layers, num_kv_heads)
        self.trunks: Optional[CrystalTrunks] = None
        self.base = -1  # absolute position of the first private token
        self.decoding = False  # set by step_inputs: on_tokens then sees generated tokens
        self.forwards = 0  # forwards that handed this request's tokens over (on_forward_tokens)
        #: (forward, HostCopy, offset, count): generated tokens on their way to the host, oldest first
        self.tokens: deque = deque()
        #: (forward, HostCopy, column): first-layer snapshots on their way to the host, oldest first
        self.snapshots: deque = deque()
        self.last_decay = 0  # decode step up to which D has decayed
        self.keep = None  # (kept positions, judged) to ship at the next step
        self.breaths = 0


@register_policy
class CrystalCachePolicy(Policy):
    name = "crystalcache"
    Params = CrystalCacheParams
    needs = Need.LAYER0_ATTENTION | Need.LAYER0_KEYS | Need.ATTENTION | Need.TOKEN_IDS
    decides_rows_apart = False  # the breath-cycle snapshot is keyed by the group's row count (_snap_states)
    keeps_slot_state = True  # the first layer's view.score: attention received since the last snapshot
    compress_prompt = True
    graph_safe = False
    description = ("CrystalCache: one index set per request over sentence trunks; prefill S1-S6 from the first "
                   "layer's attention, decode breath cycles (decay, resonance, Hebbian, re-eviction).")

    #: The first layer only: its attention and slot state are all the policy reads.
    observes_first_layer_only = True
    #: observe_decode is tensor work on the view alone; select_decode hands
    #: its snapshot to the host on a snapshot step (decide_graph_safe), so
    #: the steps between snapshots replay, the keep step included.
    observe_graph_safe = True
    crosses_heads = True  # its decode pass reduces over every rank's heads

    _due = None  # deciding_rows' answer for this step's rows
    heads_size = 1  # tensor-parallel ranks whose heads the snapshot holds

    def __init__(self):
        self._snap_states = {}
        #: ([(row, state, ids, base)], shapes, HostCopy of the packed PrefillRows) per prompt-ending step
        self._prefills = []
        self._delims = None  # (device, delimiter ids there)

    @classmethod
    def decide_graph_safe(cls, input_names) -> bool:
        """A step that applies keep tables only is tensor work (evict_outside,
        the score's sum): captured, its table's width in buckets (keep_width)
        so that a cycle replays what an earlier one captured. A snapshot step
        hands its copy to the host and records which request took it: eager."""
        return "snap" not in input_names

    def begin_request(self, params, num_layers, num_kv_heads) -> CrystalCacheState:
        return CrystalCacheState(params, num_layers, num_kv_heads)

    def _delimiters(self) -> frozenset:
        return self.model.delimiter_ids if self.model is not None else frozenset()

    # ----- admission (host) ------------------------------------------------------
    @classmethod
    def check_budget(cls, params, budget, budget_ratio):
        floor = budget_floor(params)
        if budget is not None and budget < floor:
            return "budget", (f"crystalcache needs a budget of at least {floor} tokens (sinks + recent, and "
                              f"sinks + {2 * (params.t_max - 1)} for a decode breath cycle)")
        return None

    def kept_after_prefill(self, params, private_prompt, budget):
        # Protected trunks (touching the first `sinks` or last `recent`
        # tokens, up to t_max - 1 tokens past each) may exceed B.
        protected = params.sinks + params.recent + 2 * (params.t_max - 1)
        return min(private_prompt, max(effective_budget(params, budget), protected))

    def max_private_tokens(self, params, private_prompt, max_new_tokens, budget):
        # The whole private prompt until its selection; then the kept prompt
        # (or B after a breath cycle) grows by `breath` + 2 tokens before the
        # next cycle cuts back to B (the pending sentence counts in B; the
        # two tokens after the snapshot are not judged yet).
        kept = self.kept_after_prefill(params, private_prompt, budget)
        if params.decode:
            peak = max(kept, effective_budget(params, budget)) + params.breath + 2
        else:
            peak = kept + max_new_tokens
        return min(private_prompt + max_new_tokens, max(private_prompt, peak))

    @classmethod
    def observation_window(cls, params, private_prompt):
        return 0  # the selection reads the first layer's probe, not the last queries' attention

    # ----- prefill: S1-S6 on the device, every ending prompt at once -----------------
    def prompt_attention_inputs(self, rows: list[PromptAttention], device):
        """S1-S6 for every request whose prompt ends in this step, as tensor
        work (prefill_batched.py) inside the first layer's forward: the keep
        table for every layer's select_prefill, no read-back. The trunk
        table the decode phase starts from is read at the next step."""
        lengths = [len(pa.token_ids) for pa in rows]
        N = max(lengths)
        pad = torch.nn.utils.rnn.pad_sequence
        params = [pa.state.params for pa in rows]
        ids = to_device([list(pa.token_ids) + [-1] * (N - n) for pa, n in zip(rows, lengths)], torch.int64, device)
        out = prefill_rows(
            pad([pa.saliency for pa in rows], batch_first=True),
            pad([pa.intra_index for pa in rows], batch_first=True, padding_value=-1),
            pad([pa.intra_weight for pa in rows], batch_first=True),
            pad([pa.cross_index for pa in rows], batch_first=True, padding_value=-1),
            pad([pa.cross_weight for pa in rows], batch_first=True), ids, to_device(lengths, torch.int64, device),
            self._delimiter_ids(device), to_device([effective_budget(p, pa.budget) for p, pa in zip(params, rows)],
                                                   torch.int64, device),
            to_device([p.sinks for p in params], torch.int64, device),
            to_device([p.recent for p in params], torch.int64, device),
            t_max=to_device([p.t_max for p in params], torch.int64, device),
            tau_merge=to_device([p.tau_merge for p in params], torch.float64, device),
            alpha=to_device([p.alpha for p in params], torch.float64, device),
            max_t_max=max(p.t_max for p in params))
        for pa in rows:
            pa.state.base = pa.base
        decoding = [(r, pa) for r, pa in enumerate(rows) if pa.state.params.decode]
        if decoding:
            # Packed and on its way to the host now; adopted once landed.
            packed = torch.cat([out.keep.double().flatten(), out.trunk.double().flatten(), out.impact.flatten(),
                                out.trunk_m.flatten(), out.crystal.flatten(), out.trunks.double(), out.graph.flatten()])
            self._prefills.append(([(r, pa.state, list(pa.token_ids), pa.base) for r, pa in decoding],
                                   (tuple(out.keep.shape), out.graph.numel()), HostCopy(packed)))
        bases = [pa.base for pa in rows]
        judged = [b + n for b, n in zip(bases, lengths)]
        width = max(judged) + 1
        at = to_device(bases, torch.int64, device).unsqueeze(1) + torch.arange(N, device=device)
        real = torch.arange(N, device=device) < to_device(lengths, torch.int64, device).unsqueeze(1)
        table = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
        table.scatter_(1, torch.where(real, at, width - 1), out.keep)
        table |= torch.arange(width, device=device) >= to_device(judged, torch.int64, device).unsqueeze(1)
        return {"keep": table}

    def _delimiter_ids(self, device) -> torch.Tensor:
        ids = sorted(self._delimiters()) or [-2]  # -2: no token id matches
        if self._delims is None or self._delims[0] != device:
            self._delims = (device, to_device(ids, torch.int64, device))
        return self._delims[1]

    def _adopt_prefills(self, needed=frozenset()) -> None:
        """The trunk tables of the prompts selected so far, as each request's
        decode state: those whose copy has landed, and (waiting for its copy)
        any batch holding a request in `needed` (ids of the states about to
        run a breath cycle). Adopting later than the next step changes
        nothing: only a breath cycle reads the table."""
        waiting = []
        for members, (shape, graph_size), copy in self._prefills:
            if not (copy.landed or any(id(state) in needed for _, state, _, _ in members)):
                waiting.append((members, (shape, graph_size), copy))
                continue
            host, (E, N), at = copy.tensor(), shape, 0
            fields = []
            for size in (E * N, E * N, E * N, E * N, E * N, E, graph_size):
                fields.append(host[at:at + size])
                at += size
            keep, trunk, impact, trunk_m, crystal = (f.view(E, N) for f in fields[:5])
            count, graph = fields[5], fields[6].view(E, -1, 3)
            for r, state, ids, base in members:
                n, T = len(ids), int(count[r])
                owner = trunk[r, :n].long().tolist()
                trunks: list[list[int]] = [[] for _ in range(T)]
                for p, t in enumerate(owner):
                    trunks[t].append(p)
                found = graph[r][graph[r, :, 2] > 0]
                edges = dict(zip(zip(found[:, 0].long().tolist(), found[:, 1].long().tolist()), found[:, 2].tolist()))
                kept = keep[r, :n].nonzero().flatten().tolist()
                result = PrefillResult(Dissolution(kept, [], crystal[r, :T].tolist()), trunks, impact[r, :n].clone(),
                                       trunk_m[r, :T].tolist(), edges)
                state.trunks = shifted(CrystalTrunks(result, ids, self._delimiters(), state.params.t_max,
                                                    state.params.alpha), base)
        self._prefills = waiting

    def select_prefill(self, batch, view, obs):
        view.score.zero_()
        keep = batch.inputs.get("keep")
        return None if keep is None else evict_outside(keep, view)

    # ----- decode: host, between steps ---------------------------------------------
    def on_tokens(self, state, positions, token_ids, hidden_states):
        self.on_forward_tokens([(state, 0, positions.shape[0])], positions, token_ids, hidden_states)

    def on_forward_tokens(self, requests, positions, token_ids, hidden_states):
        """The forward's generated tokens of every decoding request in one
        device gather, on their way to the host (read at a breath cycle)."""
        taken = [(st, start, n) for st, start, n in requests if st.decoding and st.params.decode]
        if taken:
            index = [t for _, start, n in taken for t in range(start, start + n)]
            at = to_device(index, torch.int64, positions.device)
            copy = HostCopy(torch.stack([positions[at].long(), token_ids[at].long()]))
            offset = 0
            for st, _, n in taken:
                st.tokens.append((st.forwards, copy, offset, n))
                offset += n
        for st, _, _ in requests:
            st.forwards += 1

    @staticmethod
    def _taken_tokens(st: CrystalCacheState, upto: int) -> list[tuple[int, int]]:
        """(position, id) of the request's tokens handed over in its forwards
        up to `upto` (the snapshot's), oldest first."""
        out = []
        while st.tokens and st.tokens[0][0] <= upto:
            _, copy, at, n = st.tokens.popleft()
            host = copy.values()
            out += zip(host[0][at:at + n], host[1][at:at + n])
        return out

    @staticmethod
    def _ready_snapshot(st: CrystalCacheState):
        """The request's oldest snapshot once two of its forwards have been
        handed over since (its forward has ended on the GPU by then), as
        (forward, host tensor [4, H, S]); else None. Counting the request's
        own forwards keeps its decisions the same in any batch."""
        if not st.snapshots or st.snapshots[0][0] >= st.forwards - 1:
            return None
        forward, copy, column = st.snapshots.popleft()
        return forward, copy.tensor()[:, column]

    def step_inputs(self, rows, device):
        self._adopt_prefills()
        self._due = None
        if not rows or rows[0].prefill:
            for row in rows:
                row.state.decoding = False
            return {}
        for row in rows:
            row.state.decoding = True
        ready = [(row, self._ready_snapshot(row.state)) for row in rows if row.state.snapshots]
        cycle = [(row, snap) for row, snap in ready if snap is not None]
        if cycle:
            self._adopt_prefills(needed={id(row.state) for row, _ in cycle})
            self._decay([row.state for row, _ in cycle], [row.step for row, _ in cycle])
            tables = position_tables([snapshot for _, (_, snapshot) in cycle])
            for (row, (forward, _)), table in zip(cycle, tables):
                self._breath(row.state, forward, table, effective_budget(row.state.params, row.budget))
        fresh = [row.state.keep for row in rows]
        snap = [row.state.params.decode and (row.step + 1) % row.state.params.breath == 0 for row in rows]
        due = [k is not None or s for k, s in zip(fresh, snap)]
        if not any(due):
            return {}
        self._due = due
        inputs = {}
        if any(k is not None for k in fresh):
            kept = [k[0] if k is not None else [] for k in fresh]
            judged = [k[1] if k is not None else 0 for k in fresh]
            inputs["keep"] = to_device(keep_table(kept, judged, keep_width(max(judged) + 1)), torch.bool, device)
            for row in rows:
                row.state.keep = None
        # The rows' states in the order select_decode sees them (the deciding
        # rows, or every row), by row count; those due a snapshot get one.
        every = [(row.state, s) for row, s in zip(rows, snap)]
        self._snap_states = {len(rows): every, sum(due): [e for e, d in zip(every, due) if d]}
        if any(snap):
            inputs["snap"] = to_device(snap, torch.bool, device)
        return inputs

    def deciding_rows(self, rows):
        """Rows with a keep table to apply or a snapshot to take this step:
        two steps per breath cycle. The others only accumulate the first
        layer's attention (observe_decode)."""
        return self._due if self._due is not None else [False] * len(rows)

    @staticmethod
    def _decay(states: list, steps: list[int]) -> None:
        """D's per-step decay since each request's last cycle, for all of them at once."""
        tables = [(st, step) for st, step in zip(states, steps) if st.trunks is not None]
        decayed = decay_rows([st.trunks.crystal for st, _ in tables], [st.trunks.trunk_m for st, _ in tables],
                             [max(step - st.last_decay, 0) for st, step in tables])
        for (st, _), crystal in zip(tables, decayed):
            st.trunks.crystal = crystal
        for st, step in zip(states, steps):
            st.last_decay = step

    def _breath(self, st: CrystalCacheState, forward: int, table: PositionTable, budget: int) -> None:
        """The breath cycle on the snapshot taken in the request's forward
        `forward` (reduced to `table`), with the tokens handed over up to it."""
        if not table.present:
            return
        # The snapshot holds every rank's heads: all query heads of the model.
        heads = max(self.model.num_q_heads * self.heads_size, 1) if self.model is not None else 1
        scale = TOP_HEADS / heads
        taken = self._taken_tokens(st, forward)
        positions = [p for p, _ in taken]
        if st.trunks is None:  # prompt kept in the radix cache: trunks from generated tokens only
            st.trunks = CrystalTrunks(_empty_prefill(), [], self._delimiters(), st.params.t_max, st.params.alpha)
            st.base = min(positions) if positions else table.present[0]
        trunks, mass = st.trunks, table.mass
        waiting = {p for p, _ in trunks.pending} | set(positions)
        trunks.receive({p: mass[p] * scale for p in waiting if p in mass})
        trunks.add_tokens(taken)
        st.breaths += 1
        if not any(trunks.trunks):  # only an unfinished sentence: nothing to judge
            return
        # Judge only what the trunk table knows (a token whose id has not
        # been seen yet stays kept until the next cycle).
        known = max(max((g[-1] for g in trunks.trunks if g), default=-1),
                    max((p for p, _ in trunks.pending), default=-1))
        kept = trunks.breath(table.inv_key_norm, budget, n_sink=st.base + st.params.sinks)
        trunks.drop_dead()
        st.keep = (kept, known + 1)

    def end_request(self, state):
        state.tokens.clear()
        state.snapshots.clear()
        state.trunks = None

    # ----- per layer (device) ------------------------------------------------------
    def observe_decode(self, batch, view, obs):
        """Between decisions: the first layer's attention accumulates in
        view.score; the other layers have nothing to do."""
        if batch.layer == 0 and obs.attention is not None:
            view.score.add_(torch.where(view.valid, obs.attention.float(), torch.zeros_like(view.score)))

    def select_decode(self, batch, view, obs):
        keep = batch.inputs.get("keep")
        evict = evict_outside(keep, view) if keep is not None else None
        if batch.layer == 0:
            valid = view.valid if evict is None else view.valid & ~evict
            if obs.attention is not None:
                view.score.add_(torch.where(valid, obs.attention.float(), torch.zeros_like(view.score)))
            snap = batch.inputs.get("snap")
            if snap is not None:
                keys = view.keys
                norms = keys.float().norm(dim=-1) if keys is not None else torch.ones_like(view.score)
                # Every rank's heads (tensor parallelism): the breath cycle
                # sums them per position, and every rank must keep the same set.
                gather, self.heads_size = batch.heads.gather, batch.heads.size
                copy = HostCopy(torch.stack([gather(t, 1).double() for t in (view.position, view.score, valid, norms)]))
                for column, (state, taken) in enumerate(self._snap_states[view.valid.shape[0]]):
                    if taken:
                        state.snapshots.append((state.forwards, copy, column))
                view.score.masked_fill_(snap.view(-1, 1, 1), 0.0)
        return evict


def prompt_edges(pa: PromptAttention) -> dict[tuple[int, int], float]:
    """S1's edge set from the probe's candidates: intra pairs with cosine
    > TAU_INTRA, cross pairs with head-mean attention > TAU_CROSS; one weight
    per unordered pair (the largest)."""
    ends, weights = [], []
    for index, weight, tau in ((pa.intra_index, pa.intra_weight, TAU_INTRA),
                               (pa.cross_index, pa.cross_weight, TAU_CROSS)):
        ok = (index >= 0) & (weight > tau)
        rows, cols = ok.nonzero(as_tuple=True)
        ends.append(torch.stack([rows, index[rows, cols]]))
        weights.append(weight[rows, cols])
    pairs, weight = torch.cat(ends, dim=1), torch.cat(weights)
    order = weight.argsort(stable=True)  # ascending: a pair's largest weight is written last
    low, high = pairs.min(dim=0).values[order].tolist(), pairs.max(dim=0).values[order].tolist()
    return dict(zip(zip(low, high), weight[order].tolist()))


def shifted(trunks: CrystalTrunks, base: int) -> CrystalTrunks:
    """The trunk table in absolute positions (local + base)."""
    if base:
        trunks.trunks = [[p + base for p in g] for g in trunks.trunks]
        trunks.impact = {p + base: m for p, m in trunks.impact.items()}
    return trunks


def _empty_prefill() -> PrefillResult:
    return PrefillResult(Dissolution([], [], []), [], torch.zeros(0, dtype=torch.float64), [], {})
