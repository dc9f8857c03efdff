"""kvsieve's attention backend (SGLang registry name "kvsieve").

It wraps SGLang's own backend for the platform (triton on GPU, torch_native
on CPU). A batch without compressed rows goes to that backend unchanged, so
`full` traffic runs at SGLang's speed (CUDA graphs included). In a batch
with compressed rows, the other rows run SGLang's backend on their subset
(step_meta.sub_batch) and the compressed rows go through one batched pass
per layer:

1. store the new K/V in the region: in decode each (row, head)'s first free
   slot, found on the device; in an extend the prompt chunk's slots, in one
   write;
2. attend over the shared prefix (SGLang's token pool through req_to_token)
   plus the region pages (through the page table), producing the
   observations the policies asked for (kernels.attention_ref);
3. one batched decision per policy class present (policies.base);
4. evictions clear valid bits; a prompt that ends in this step is selected
   and compacted to the front of its pages, so the page manager can give the
   rest back after the step.

All host work (which rows, prefix lengths, budgets, parameters) is done once
per step in step_meta.py; the per-layer code below has no Python loop over
rows, heads, slots or tokens and no host-device sync.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from kvsieve.kernels.attention_ref import attend_rows
from kvsieve.kernels.decode_attention import decode_attention
from kvsieve.kernels.extend_attention import extend_attention
from kvsieve.kernels import region_store, slot_view
from kvsieve.policies import Need, Observations, SlotView

from . import (faults, forward_graphs, head_parallel, kernel_warmup, layer0_probe, layer_blocks, logit_guard,
               memory_plan, memory_split, metrics, region_graphs, step_meta, tbq_store)
from .forward_graphs import ForwardGraphs
from .model_info import build_model_info
from .profiling import recording, span
from .query_ring import QueryRing
from .region_graphs import RegionGraphs
from .runtime import RUNTIME
from .step_log import StepLog
from .step_meta import StepBuilder, StepMeta

logger = logging.getLogger(__name__)

#: Prompt queries attended together: bounds the [rows, queries, heads, slots] logits.
EXTEND_QUERY_BLOCK = 256


def _platform_backend(model_runner):
    """SGLang's backend for rows that keep SGLang's KV path."""
    if model_runner.device == "cuda":
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend(model_runner)
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return TorchNativeAttnBackend(model_runner)


def observed_rows(policy, obs: Observations, rows: torch.Tensor, slots: Optional[int] = None) -> Observations:
    """The observations `policy` asked for (Policy.needs), of `rows` and
    their first `slots` slots (a decode group's width: its page-table
    columns lead the step's, so its slots are a prefix of the step's): a
    group reads only its own kinds, so its captured pass does not depend on
    what the other groups of the step asked for."""
    needs = policy.needs
    cut = slice(None) if slots is None else slice(0, slots)

    def pick(kind, t):
        return t[rows, :, cut] if t is not None and needs & kind else None
    return Observations(attention=pick(Need.ATTENTION, obs.attention), pv_norm=pick(Need.PV_NORM, obs.pv_norm),
                        sparsity=obs.sparsity[rows] if obs.sparsity is not None and needs & Need.SPARSITY else None)


def _private_ids(req) -> list:
    """The private prompt's token ids, from SGLang's Req (host lists); -1s
    when the request has none (direct engine use)."""
    sgl = req.sgl_req
    ids = list(getattr(sgl, "origin_input_ids", None) or []) + list(getattr(sgl, "output_ids", None) or [])
    private = ids[req.prefix_len:req.prompt_len]
    return private if len(private) == req.prompt_len - req.prefix_len else [-1] * (req.prompt_len - req.prefix_len)


class KvsieveAttnBackend(AttentionBackend):
    #: Need.QUERIES: every req_pool row's latest decode queries, made at the
    #: first step that needs them (query_ring.py).
    query_ring: Optional[QueryRing] = None
    #: Slots one group pass may span (memory_plan: pass_scratch), which
    #: bounds a stacked pass's layers (layer_blocks.py); None off the plan (CPU).
    pass_slots: Optional[int] = None
    #: Policy calls run on the host (eagerly, or recorded into a graph): a
    #: stacked pass is one call for its layers.
    policy_calls: int = 0

    def __init__(self, model_runner):
        super().__init__()
        self.inner = _platform_backend(model_runner)
        head_parallel.init_from_sglang()
        pool = model_runner.token_to_kv_pool
        self.token_to_kv_pool = pool
        self.num_layers = pool.layer_num
        self.device = model_runner.device
        self.pages = RUNTIME.ensure_region(
            pool.layer_num, pool.head_num, pool.head_dim, pool.dtype, self.device, pool_tokens=pool.size,
            max_rows=model_runner.req_to_token_pool.req_to_token.shape[0],
            context_len=model_runner.model_config.context_len)
        if RUNTIME.model_info is None:
            RUNTIME.model_info = build_model_info(model_runner, pool.layer_num, pool.head_num, pool.head_dim)
        self.steps = StepBuilder(self.pages, model_runner.req_to_token_pool.req_to_token, self.device)
        self.step: StepMeta | None = None
        #: Decode and extend attention of compressed rows: the Triton kernels on GPU, the
        #: PyTorch reference on CPU (KVSIEVE_DECODE_KERNEL=torch|triton overrides).
        choice = os.environ.get("KVSIEVE_DECODE_KERNEL", "triton" if self.device == "cuda" else "torch")
        if choice not in ("triton", "torch"):
            raise ValueError(f"KVSIEVE_DECODE_KERNEL must be 'triton' or 'torch', not {choice!r}")
        self.use_kernel = choice == "triton"
        #: The new token's store in one Triton kernel a layer where the kernels run
        #: (kernels/region_store.py; KVSIEVE_FUSED_STORE=0 keeps the PyTorch writes).
        self.fused_store = self.use_kernel and region_store.enabled()
        #: A group's slot view in one Triton kernel a layer where the kernels run
        #: and its write-back (kernels/slot_view.py; KVSIEVE_FUSED_VIEW=0 keeps one PyTorch
        #: gather and one indexed write per buffer).
        self.fused_view = self.use_kernel and slot_view.enabled()
        #: CUDA graphs of the compressed decode pass (GPU; KVSIEVE_REGION_GRAPHS=0 turns them off).
        #: Under tensor parallelism only for passes without a collective
        #: (region_graphs.capturable): LongFlow's, ThinKV's and
        #: CrystalCache's have not been captured and checked on a multi-GPU host.
        self.graphs = RegionGraphs(rerun=region_graphs.mode() == "rerun") if region_graphs.enabled(self.device) else None
        if self.graphs is not None:
            self.graphs.first_sight = region_graphs.first_sight_enabled()
            self.graphs.observations.num_layers = pool.layer_num  # one buffer a kind for every layer
        #: The whole decoder stack of all-compressed decode steps, replayed on
        #: top of the region graphs' entries (KVSIEVE_FORWARD_GRAPHS=0 turns it off).
        #: Not under tensor parallelism: the model's own all-reduces would
        #: need SGLang's graph-capture context around the capture.
        self.forward_graphs = None
        decoder = forward_graphs.decoder_of(model_runner.model)
        if (self.graphs is not None and forward_graphs.enabled() and decoder is not None
                and head_parallel.SHARDS.size == 1):
            self.forward_graphs = ForwardGraphs(decoder, self.graphs, pool.layer_num, after_stack=self.after_stack)
            self.graphs.defer_groups = region_graphs.defer_enabled()
            self.graphs.eager_defer = self.graphs.defer_groups and region_graphs.eager_defer_enabled()
            work = memory_split.workspace  # planned at start where the region was carved (GPU)
            if work is not None:
                self.graphs.plan_observations(work.deferred_obs, pool.layer_num, self.pages.config.page_size)
        #: Policy groups padded to bucketed row counts where graphs replay
        #: (step_meta.row_bucket; KVSIEVE_GRAPH_BUCKETS=0 turns it off).
        self.steps.pad_rows = self.graphs is not None and region_graphs.buckets_enabled()
        #: `full` rows beside compressed ones run in our pass, so that such a
        #: step can replay its whole stack (KVSIEVE_FOLD_POOL_ROWS=0: they run
        #: SGLang's backend, and those steps replay per layer).
        self.steps.fold_pool_rows = self.forward_graphs is not None and forward_graphs.folds_pool_rows()
        # As wide as the plan made their prefix tables (where the region was
        # carved on a GPU), else the setting's own bound.
        work = memory_split.workspace
        self.pass_slots = work.pass_scratch // (2 * memory_plan.PASS_BYTES_PER_SLOT) if work is not None else None
        self.steps.fold_max_tokens = work.fold_tokens if work is not None else \
            memory_plan.fold_max_tokens(model_runner.model_config.context_len)
        self.step_log = StepLog.from_env()  # KVSIEVE_STEP_LOG: where a serving run's time goes
        logger.warning("kvsieve: compressed rows' attention (decode and extend) runs %s",
                       "the Triton kernels (kernels/decode_attention.py, extend_attention.py)" if self.use_kernel
                       else "the PyTorch reference (kernels/attention_ref.py)")

        # Token ids and the last layer's hidden states reach policies from
        # the input of the model's logits processor, which every SGLang
        # causal LM calls with (input_ids, hidden_states, lm_head, forward_batch).
        logits_processor = getattr(model_runner.model, "logits_processor", None)
        if logits_processor is not None:
            logits_processor.register_forward_pre_hook(self._observe_tokens, with_kwargs=True)
            logit_guard.install(logits_processor)  # a row of NaN logits ends its request, not the server
        if self.use_kernel and torch.device(self.device).type == "cuda":
            # Every observation variant of the decode kernels now, not at a batch's first need of it.
            kernel_warmup.warm_up_backend(self, RUNTIME.model_info.num_q_heads, model_runner.model_config.dtype)

    # Everything this class does not define (CUDA-graph state and metadata,
    # fill values) is SGLang's backend's: graphs run batches without
    # compressed rows only (plugin.graphs_skip_compressed_batches).
    def __getattr__(self, name):
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        return self.inner.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        return self.inner.init_forward_metadata_out_graph(forward_batch, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch):
        return self.inner.init_forward_metadata_in_graph(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def support_triton(self):
        return self.inner.support_triton()

    # ----- once per step ----------------------------------------------------
    def init_forward_metadata(self, forward_batch):
        started = time.perf_counter()
        RUNTIME.after_step()  # host bookkeeping of the previous step (rate-limited)
        with span("kvsieve.step_meta"):
            self.step = self.steps.build(forward_batch)
        if self.graphs is not None:
            decode = self.step is not None and self.step.region is not None and self.step.extend is None
            if decode and not recording():
                self.graphs.begin_step(self.step, needs_keys=bool(self.step.region.needs & Need.KEYS),
                                       table=self.pages.table)
            else:
                self.graphs.current = None
            if self.forward_graphs is not None:
                self.forward_graphs.begin_step(self.step, forward_batch.batch_size)
        if self.step_log is not None:
            self.step_log.record(forward_batch, self.step, self.graphs, self.forward_graphs,
                                 meta_ms=1000 * (time.perf_counter() - started))
            self.step_log.mark("forward")
        if self.step is None:
            self.inner.init_forward_metadata(forward_batch)
        elif self.step.pool_batch is not None:
            self.inner.init_forward_metadata(self.step.pool_batch)

    def _observe_tokens(self, module, args, kwargs):
        if not RUNTIME.token_observers:
            return None
        names = ("input_ids", "hidden_states", "lm_head", "logits_metadata")
        given = dict(zip(names, args)) | kwargs
        forward_batch = given.get("logits_metadata")
        hidden = given.get("hidden_states")
        if forward_batch is None or hidden is None or not hasattr(forward_batch, "rids"):
            return None
        RUNTIME.observe_tokens(forward_batch, given["input_ids"], hidden)
        return None

    # ----- SGLang entry points ------------------------------------------------
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        step = self.step
        if step is None or layer.is_cross_attention:
            return self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        q3, k3, v3, o3 = self._shapes(q, k, v, layer)
        if save_kv_cache:
            # Every row's tokens go to the pool slots SGLang allocated; a
            # compressed row's private prompt slots are freed once its prefill
            # ends (decode_slots.free_private_prompt_slots).
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        if step.pool_batch is not None:
            t = step.pool_token_index
            out = self.inner.forward_extend(q3[t].flatten(1), k3[t], v3[t], layer, step.pool_batch,
                                            save_kv_cache=False)
            o3[t] = out.view(t.shape[0], *o3.shape[1:])
        if step.zero_token_index is not None:
            o3.index_fill_(0, step.zero_token_index, 0)
        if step.region is not None:
            self._extend_region(q3, k3, v3, o3, layer, step)
        return o3.flatten(1)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        captured = self.forward_graphs.capturing if self.forward_graphs is not None else None
        if captured is not None:
            # The whole decoder stack is being recorded (forward_graphs.py):
            # every row is a region row, in order, and the pass reads the
            # entry's static metadata. The pool write goes to the static
            # out_slots: pool-only rows' real slots (their KV lives there,
            # step_meta.StepBuilder.fold_pool_rows), SGLang's dummy slot 0
            # for compressed and padded rows (decode_slots.py), never read.
            q3, k3, v3, o3 = self._shapes(q, k, v, layer)
            if save_kv_cache:
                self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(captured.step.region.out_slots, None), k, v)
            if self.graphs.defer_step:
                # Attention only; the groups run after the stack (after_stack).
                obs = self.decode_attend(q3, k3, v3, o3, layer, captured.step)
                self.graphs.store_layer(self, layer, obs)
            else:
                self._decode_region(q3, k3, v3, o3, layer, captured.step)
            return o3.flatten(1)
        step = self.step
        if step is None or layer.is_cross_attention:
            return self.inner.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        q3, k3, v3, o3 = self._shapes(q, k, v, layer)
        if save_kv_cache:
            # Compressed rows write to slot 0, SGLang's dummy slot (decode_slots.py).
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        if step.pool_batch is not None:
            i = step.pool_batch_index
            out = self.inner.forward_decode(q3[i].flatten(1), k3[i], v3[i], layer, step.pool_batch,
                                            save_kv_cache=False)
            o3[i] = out.view(i.shape[0], *o3.shape[1:])
        if step.zero_batch_index is not None:
            o3.index_fill_(0, step.zero_batch_index, 0)
        if step.region is not None:
            if self.graphs is None or not self.graphs.run(self, layer, q3, k3, v3, o3):
                if self.graphs is not None and self.graphs.defers_eagerly():
                    # Attention only; the groups run after the stack (after_stack).
                    self.graphs.store_eager_layer(layer, self.decode_attend(q3, k3, v3, o3, layer, step))
                else:
                    self._decode_region(q3, k3, v3, o3, layer, step)
            if self.graphs is None or not self.graphs.deferred():
                self.flush_groups(step, slice(layer.layer_id, layer.layer_id + 1))
        return o3.flatten(1)

    def after_stack(self, replayed: bool) -> None:
        """Called by forward_graphs after every run of the decoder stack:
        where the groups were deferred (region_graphs.RegionGraphs.
        defer_groups), their passes over every layer, then the TBQ flush of
        every layer; a stack replayed whole with groups inside it flushes
        only (its layers flushed nothing)."""
        if self.step_log is not None:
            self.step_log.mark("stack")
        step = self.step
        if step is None or step.region is None or step.extend is not None or self.graphs is None:
            return
        if self.graphs.deferred():
            self.graphs.run_groups(self)
            self.flush_groups(step)
        elif replayed:
            self.flush_groups(step)
        if self.step_log is not None:
            self.step_log.mark("end")

    def flush_groups(self, step, layers=slice(None)) -> None:
        """TBQ: the rows whose full-precision group is whole move it to
        quantized pages in `layers` (eager: its rows change every step), in
        one call with those layers' table rows stacked (tbq_store.flush_rows
        has a host sync per call). No later layer of a step reads an earlier
        layer's region, so a step replayed whole (forward_graphs.py) flushes
        every layer after the stack; an eager step flushes each layer after
        its pass."""
        rows = step.region
        if rows is None or rows.flush_rows is None:
            return
        tables = rows.tables[rows.flush_rows, layers]  # [Rf, L, H, M]
        Rf, L = tables.shape[:2]
        with span("kvsieve.tbq_flush"):
            overflow = tbq_store.flush(self.pages, tables.flatten(0, 1), rows.flush_format.repeat_interleave(L))
            RUNTIME.flag_overflow(rows.pool_rows[rows.flush_rows], overflow.view(Rf, L).any(-1))

    # ----- the batched compressed pass ----------------------------------------
    @staticmethod
    def _shapes(q, k, v, layer):
        Hq, H, D = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        q3 = q.reshape(-1, Hq, D)
        k3, v3 = k.view(-1, H, D), v.view(-1, H, layer.v_head_dim)
        return q3, k3, v3, q3.new_empty((q3.shape[0], Hq, layer.v_head_dim))

    def _prefix_kv(self, layer, rows):
        slots = rows.prefix_slots  # [R, P]
        k = self.token_to_kv_pool.get_key_buffer(layer.layer_id)[slots]
        v = self.token_to_kv_pool.get_value_buffer(layer.layer_id)[slots]
        return k, v  # [R, P, H, D]

    def _flat(self, buffer, table):
        """buffer's slots of page-table rows `table` [R, H, M], as [R, H, S, ...]."""
        R, H, M = table.shape
        return buffer[table].reshape(R, H, M * self.pages.config.page_size, *buffer.shape[2:])

    def _flat_kv(self, table, values: bool = True):
        """K (and V) [R, H, S, D] of the slots of `table`, each page read at
        its precision (PageManager.kv_of)."""
        R, H, M = table.shape
        k, v = self.pages.kv_of(table, values)
        S = M * self.pages.config.page_size
        return k.reshape(R, H, S, -1), (v.reshape(R, H, S, -1) if values else None)

    def _view(self, table, keys: bool, state: bool = True) -> SlotView:
        """The policies' view of the slots of page-table rows `table`; the
        keys (a gather of every slot's K) only when a policy reads them, the
        slot state (score, last_hit) only when one keeps it (two [R, H, S]
        gathers per layer that streaming, snapkv or longflow never read)."""
        p = self.pages
        gather = slot_view.gather_view if self.fused_view else slot_view.gather_view_reference
        valid, position, score, last_hit = gather(table, p.valid, p.position, p.score if state else None,
                                                  p.last_hit if state else None)
        return SlotView(valid=valid, position=position, score=score, last_hit=last_hit,
                        keys=self._flat_kv(table, values=False)[0] if keys else None)

    def _slots(self, table):
        """K, V [R, H, S, D] of the slots of page-table rows `table` and their SlotView."""
        k, v = self._flat_kv(table)
        view = self._view(table, keys=False)
        view.keys = k
        return k, v, view

    def _decode_region(self, q3, k3, v3, o3, layer, step):
        """The compressed rows' decode pass of one layer, eagerly (or inside
        a whole-stack capture): store and attend, then each policy group."""
        obs = self.decode_attend(q3, k3, v3, o3, layer, step)
        for group in step.region.groups:
            self.decode_group(group, layer, obs)

    def decode_attend(self, q3, k3, v3, o3, layer, step) -> Observations:
        """Steps 1-2 for every region row: store the new token, attend, and
        return the observations the groups asked for."""
        rows, p = step.region, self.pages
        table = rows.tables[:, layer.layer_id]  # [R, H, M]
        idx = rows.batch_index
        needs = rows.needs if layer.layer_id == 0 else rows.later_needs
        # 1. The new token goes to each (row, head)'s first free slot.
        with span("kvsieve.store"):
            store = region_store.store_new_tokens if self.fused_store else region_store.store_new_tokens_reference
            store(table, idx, rows.positions, rows.pool_rows, k3, v3, p.k, p.v, p.valid, p.vnorm, p.position,
                  p.score, p.last_hit, RUNTIME.overflow_flags, p.null_page, zero=p.const_zero,
                  zero_int=p.const_zero_int, row_columns=rows.columns)
            if needs & Need.QUERIES:
                self._keep_queries(q3[idx], rows, layer.layer_id)
        # 2. Attention over prefix + region, with the observations asked for.
        with span("kvsieve.attend"):
            if self.use_kernel:
                pool = self.token_to_kv_pool
                out, obs = decode_attention(q3[idx], pool.get_key_buffer(layer.layer_id),
                                            pool.get_value_buffer(layer.layer_id), rows.prefix_slots, rows.prefix_lens,
                                            p.k, p.v, p.valid, table, layer.scaling, needs, region_vnorm=p.vnorm,
                                            quant=p.quant, formats=p.format, row_columns=rows.columns,
                                            row_observe=rows.observe,
                                            observe_shift=0 if layer.layer_id == 0 else step_meta.LATER_LAYERS_SHIFT)
                o3[idx[:rows.real]] = out[:rows.real].to(o3.dtype)
            else:
                rk, rv, view = self._slots(table)
                pk, pv = self._prefix_kv(layer, rows)
                out, obs = attend_rows(q3[idx].unsqueeze(1), pk, pv, rows.prefix_mask, rk, rv,
                                       view.valid.unsqueeze(1), layer.scaling, needs)
                o3[idx[:rows.real]] = out[:rows.real, 0].to(o3.dtype)  # padded rows' outputs dropped
        return obs

    def _keep_queries(self, q, rows, layer_id: int) -> None:
        """Need.QUERIES: each row's query of this step into its ring (padded
        rows write SGLang's padding row, which no request has)."""
        if self.query_ring is None:
            self.query_ring = QueryRing.for_queries(self.pages.config.max_rows, self.num_layers, q)
        self.query_ring.keep(layer_id, rows.pool_rows, rows.positions, q)

    def decode_group(self, group, layer, obs) -> None:
        """Steps 3-4 for one policy group of a decode step: its decision (or
        observation) over its rows' slots, written back to the region. Reads
        nothing of other groups, so a captured graph of it replays in any
        batch composition (region_graphs.py)."""
        if self.group_idle(group, layer):
            return
        deciding = group.action == "decide"
        table = self.pages.table[group.pool_rows, layer.layer_id, :, :group.width]  # [Rg, H, M]
        self._group_pass(group, layer, table, observed_rows(group.policy, obs, group.rows,
                                                           group.width * self.pages.config.page_size),
                         prefill=False, stage="decide" if deciding else "observe")

    def decode_group_layers(self, group, layers: list, obs: list) -> None:
        """One group's decode pass over `layers` (each with its observations
        in `obs`), after the decoder stack: in blocks of layers stacked as
        rows where the policy decides layers apart (layer_blocks.py), else
        one layer at a time."""
        block = self._layer_block(group)
        if block < 2 or len(layers) < 2:
            for layer, layer_obs in zip(layers, obs):
                self.decode_group(group, layer, layer_obs)
            return
        obs_of = {layer.layer_id: layer_obs for layer, layer_obs in zip(layers, obs)}
        for run in layer_blocks.blocks(layers, block):
            if len(run) == 1:
                self.decode_group(group, run[0], obs_of[run[0].layer_id])
            else:
                self._decode_group_block(group, run, [obs_of[layer.layer_id] for layer in run])

    def _layer_block(self, group) -> int:
        """Layers per stacked pass of `group` (1: none), from the plan's bounds."""
        policy = group.policy
        if (not policy.decides_layers_apart or policy.observes_first_layer_only or group.layer_ids is not None
                or not group.members or not group.splittable()):
            return 1
        p = self.pages
        heads, slots = p.table.shape[2], group.width * p.config.page_size
        key_rows = None
        if group.action == "decide" and policy.needs & Need.KEYS:
            key_rows = step_meta.decision_rows_limit(heads, step_meta.decision_key_slots(policy, group.inputs, slots),
                                                     p.config.head_dim, p.k.element_size())
        return layer_blocks.block_size(len(group.members), heads, slots, p.table.shape[1], self.pass_slots, key_rows)

    def _decode_group_block(self, group, run: list, obs: list) -> None:
        """`group` over the consecutive layers `run` as one call. Out of
        memory (eagerly): those layers one at a time instead, each with the
        one-layer pass's own retry on halves of the rows."""
        if group.failed:
            return
        first = run[0].layer_id
        stacked = group.over_layers([layer.layer_id for layer in run])
        slots = group.width * self.pages.config.page_size
        table = layer_blocks.stacked_table(self.pages.table, group.pool_rows, first, len(run), group.width)
        parts = layer_blocks.observed_block(group.policy, obs, group.rows, slots)
        try:
            self._call_policy(stacked, run[0], table, parts, prefill=False)
        except Exception as exc:  # noqa: BLE001 - policy code: its fault stays with its requests
            if faults.capturing():
                raise  # a capture that fails is dropped (region_graphs.RegionGraphs)
            if faults.is_out_of_memory(exc):
                del exc  # its traceback holds the tensors that did not fit
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                for layer, layer_obs in zip(run, obs):
                    self.decode_group(group, layer, layer_obs)
                return
            faults.fail_requests(group.requests, group.policy.name,
                                 "decide" if group.action == "decide" else "observe", exc)
            group.failed = True

    @staticmethod
    def group_idle(group, layer) -> bool:
        """Whether a decode group does nothing in this layer: it failed in
        this step, or it only observes and its policy observes the first
        layer only."""
        return group.failed or (group.action != "decide" and layer.layer_id > 0
                                and group.policy.observes_first_layer_only)

    def _group_pass(self, group, layer, table, obs, prefill, stage) -> None:
        """Run one group's decision over the slots of its page-table rows
        `table` [Rg, H, M] and write what it changed back to the region. Out
        of memory: retried on each half of the group's rows (a decision is
        per row, and the region is untouched until a decision returns), down
        to one row. Any other fault, or one row that still does not fit: the
        group's requests end with an error and it sits out the rest of the
        step (faults.py)."""
        try:
            self._call_policy(group, layer, table, obs, prefill)
        except Exception as exc:  # noqa: BLE001 - policy code: its fault stays with its requests
            if faults.capturing():
                raise  # a capture that fails is dropped (region_graphs.RegionGraphs)
            n = len(group.members)
            if faults.is_out_of_memory(exc) and n > 1 and group.policy.decides_rows_apart and group.splittable():
                del exc  # its traceback holds the tensors that did not fit
                metrics.DECISION_RETRIES.labels(group.policy.name).inc()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                half = n // 2
                for part in (list(range(half)), list(range(half, n))):
                    index = torch.tensor(part, dtype=torch.long, device=table.device)
                    self._group_pass(group.subset(part, group.action), layer, table[index], obs.rows(index),
                                     prefill, stage)
                return
            faults.fail_requests(group.requests, group.policy.name, stage, exc)
            group.failed = True

    def _recent_queries(self, group, layer):
        """The query ring of the group's rows in `layer`, or, for a stacked
        group, in each of its layers (layer-major, as its rows)."""
        if group.layer_ids is None:
            return self.query_ring.recent(layer.layer_id, group.pool_rows)
        n = group.pool_rows.shape[0] // len(group.layer_ids)
        rings = [self.query_ring.recent(lid, group.pool_rows[:n]) for lid in group.layer_ids]
        return torch.cat([q for q, _ in rings]), torch.cat([pos for _, pos in rings])

    def _call_policy(self, group, layer, table, obs, prefill) -> None:
        """`obs` holds the rows of `table`, in order."""
        p = self.pages
        policy = group.policy
        deciding = group.action == "decide"
        # Keys only for the rows of a decision that reads them (Need.KEYS):
        # a gather of [rows, heads, slots, head_dim], as large as the K read
        # by attention, so never for rows that only observe. Groups that read
        # them come in row chunks bounded by KVSIEVE_DECISION_SCRATCH_MB
        # (step_meta.chunk_key_readers).
        wants_keys = deciding and bool(policy.needs & Need.KEYS or (layer.layer_id == 0
                                                                   and policy.needs & Need.LAYER0_KEYS))
        # Slot state (score, last_hit) only for a policy that keeps it, and
        # in decode not past the first layer for one that observes the first
        # only (the same in any batch: a group's view never depends on what
        # the step's other groups keep).
        stateful = policy.keeps_slot_state and (prefill or not (layer.layer_id and policy.observes_first_layer_only))
        with span("kvsieve.view"):
            view = self._view(table, keys=wants_keys, state=stateful)
            if deciding and not prefill and policy.needs & Need.QUERIES and self.query_ring is not None:
                # From the ring's persistent buffers by the group's own rows:
                # a captured group pass reads the same ones on replay.
                view.queries, view.query_position = self._recent_queries(group, layer)
        batch = group.batch(layer.layer_id, table.shape[1])
        self.policy_calls += 1
        if prefill:
            decide = policy.select_prefill
        else:
            decide = policy.select_decode if deciding else policy.observe_decode
        with span(f"kvsieve.{'decide' if deciding else 'observe'}.{policy.name}"):
            chosen = decide(batch, view, obs)
        if chosen is None and not stateful:
            return  # nothing evicted, no slot state: the region stays as it is
        with span("kvsieve.evict"):
            kept = None
            if chosen is not None:
                evict = chosen & view.valid
                kept = view.valid & ~evict
                RUNTIME.count_evictions(group.pool_rows, evict.sum(dim=(1, 2)))
            # One kernel for every buffer written (kernels/slot_view.py), as the view's gather.
            write = slot_view.write_back if self.fused_view else slot_view.write_back_reference
            write(table, p.valid, p.position, p.score if stateful else None, p.last_hit if stateful else None,
                  kept, view.position, view.score, view.last_hit)

    def _extend_region(self, q3, k3, v3, o3, layer, step):
        rows, ext, p = step.region, step.extend, self.pages
        table = rows.tables[:, layer.layer_id]  # [R, H, M]
        R, H, M = table.shape
        P = p.config.page_size
        # 1. The chunk's tokens take the next slots of their rows, in one write.
        heads = torch.arange(H, device=table.device)
        page = table[ext.token_row.unsqueeze(1), heads.unsqueeze(0), (ext.token_slot // P).unsqueeze(1)]  # [N, H]
        offset = (ext.token_slot % P).unsqueeze(1)
        t = ext.token_index
        p.k[page, offset] = k3[t].to(p.k.dtype)
        p.v[page, offset] = v3[t].to(p.v.dtype)
        p.vnorm[page, offset] = v3[t].float().abs().sum(-1)
        p.valid[page, offset] = p.const_true
        p.position[page, offset] = ext.query_pos[ext.token_row, ext.token_col].unsqueeze(1)
        p.score[page, offset] = p.const_zero
        p.last_hit[page, offset] = p.const_zero_int
        # 2. Causal attention over prefix + region (same kernel choice as decode).
        q_rows = q3.new_zeros((R, ext.max_len, *q3.shape[1:]))
        q_rows[ext.token_row, ext.token_col] = q3[t]
        observed = Need.ATTENTION if rows.needs & Need.ATTENTION else Need.NONE
        if self.use_kernel:
            pool = self.token_to_kv_pool
            out_rows, attention = extend_attention(
                q_rows, ext.query_pos, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
                rows.prefix_slots, rows.prefix_lens, p.k, p.v, p.valid, p.position, table, layer.scaling,
                observe=ext.observe if observed else None)
            # No dense prefix gather here; layer 0's prompt probe, where present, reads the prefix keys.
            pk = self._prefix_kv(layer, rows)[0] if layer.layer_id == 0 and getattr(ext, "probe", None) else None
        else:
            rk, rv, view = self._slots(table)
            pk, pv = self._prefix_kv(layer, rows)
            out_rows = q3.new_empty((R, ext.max_len, q3.shape[1], o3.shape[2]))
            attention = torch.zeros_like(view.score)
            for b in range(0, ext.max_len, EXTEND_QUERY_BLOCK):  # blocks of queries, known on the host
                pos = ext.query_pos[:, b:b + EXTEND_QUERY_BLOCK]  # [R, Tb]
                mask = view.valid.unsqueeze(1) & (view.position.unsqueeze(1) <= pos.view(R, -1, 1, 1)) \
                    & (pos >= 0).view(R, -1, 1, 1)
                out, obs = attend_rows(q_rows[:, b:b + EXTEND_QUERY_BLOCK], pk, pv, rows.prefix_mask, rk, rv, mask,
                                       layer.scaling, observed, observe=ext.observe[:, b:b + EXTEND_QUERY_BLOCK])
                out_rows[:, b:b + EXTEND_QUERY_BLOCK] = out
                if observed:
                    attention += obs.attention
        o3[t] = out_rows[ext.token_row, ext.token_col].to(o3.dtype)
        if observed:
            # Summed over prefill chunks in the region, until the selection reads it.
            shape = (*table.shape, P)
            p.prefill_attention[table] = (p.prefill_attention[table] + attention.reshape(shape))
        if ext.probe and layer.layer_id == 0:
            self._probe_prompt(q3, table, pk, ext, layer.scaling)
        if ext.ending.numel():
            self._select_prompt(layer, table[ext.ending], ext)

    def _probe_prompt(self, q3, table, pk, ext, scale):
        """Need.LAYER0_ATTENTION (first layer only): probe the rows' prompt
        queries (layer0_probe.py); for rows whose prompt ends here, hand the
        summaries to their policies (one read-back for all of them) and add
        what the policies build to their groups' inputs, before any layer's
        select_prefill reads them."""
        ended = {}
        for pr in ext.probe:  # rows of probed policies only, bounded on the host
            req = pr.request
            if req.overflowed:
                continue
            try:
                with faults.guard("probe", req.policy.name, [req]):
                    private = req.prompt_len - req.prefix_len
                    state = layer0_probe.state_of(req.state, private, pr.first, table.device)
                    keys = self._flat(self.pages.k, table[pr.row:pr.row + 1])[0]  # [H, S, D]
                    # Under tensor parallelism every rank probes every head (one index
                    # set for the request): gather queries and keys along the heads.
                    heads = head_parallel.SHARDS
                    layer0_probe.observe(state, heads.gather(q3[pr.token_start:pr.token_start + pr.count], 1),
                                         heads.gather(keys, 0), heads.gather(pk[pr.row, :req.prefix_len], 1),
                                         scale)
                    if state.done >= private:
                        ended[pr.row] = (req.state, _private_ids(req), req.prefix_len, pr.budget)
            except faults.PolicyFault:
                continue  # that request ends; its group's selection finds no summary for it
        if not ended:
            return
        requests = [pr.request for pr in ext.probe if pr.row in ended]
        try:
            with faults.guard("probe", requests[0].policy.name, requests):
                summaries = dict(zip(ended, layer0_probe.collect(list(ended.values()))))
        except faults.PolicyFault:
            return
        for group in ext.ending_groups:
            if group.policy.needs & Need.LAYER0_ATTENTION and not group.failed:
                rows = [summaries.get(ext.ending_rows[m]) for m in group.members]
                if all(r is not None for r in rows):
                    try:
                        with faults.guard("probe", group.policy.name, group.requests):
                            group.inputs.update(group.policy.prompt_attention_inputs(rows, table.device))
                    except faults.PolicyFault:
                        group.failed = True

    def _select_prompt(self, layer, table, ext):
        """The private prompt of these rows is whole: let their policies
        select, then compact each head's kept tokens to its first slots."""
        p = self.pages
        R, H, M = table.shape
        P = p.config.page_size
        shape = (R, H, M * P)
        obs = Observations(attention=p.prefill_attention[table].reshape(shape))
        for group in ext.ending_groups:  # rows indexing `ending`, i.e. `table`
            if not group.failed:
                self._group_pass(group, layer, table[group.rows], observed_rows(group.policy, obs, group.rows),
                                 prefill=True, stage="prefill")
        kept = self._flat(p.valid, table)
        # Compaction: a stable sort puts kept slots first in slot order.
        order = (~kept).to(torch.int8).argsort(dim=-1, stable=True)  # [R, H, S]
        for buffer in (p.k, p.v, p.vnorm, p.valid, p.position, p.score, p.last_hit):
            slots = buffer[table].reshape(*shape, *buffer.shape[2:])
            index = order.view(*shape, *([1] * (buffer.dim() - 2))).expand_as(slots)
            buffer[table] = slots.gather(2, index).reshape(*table.shape, P, *buffer.shape[2:])
        p.prefill_attention[table] = p.const_zero
