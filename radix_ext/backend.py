"""kvsieve's attention backend (SGLang registry name "kvsieve").

Rows of requests without a compressing policy take SGLang's torch_native path
unchanged. A compressed request keeps its private tokens (the prompt tail
past the radix-matched prefix, and every generated token) in the compressed
region. Its attention, in extend and in decode, reads the shared prefix from
SGLang's token pool plus its region slots, with one softmax over both
(kernels.attention_ref); the policy then decides evictions from the
observations of that same pass.

Its tokens take no token-pool slot once its prefill ends: generated tokens
are given SGLang's dummy slot (decode_slots.py) and the private prompt's
slots are freed after the last prefill chunk (plugin.py).
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from kvsieve.kernels.attention_ref import attend, attend_decode
from kvsieve.policies import LayerObservations, Need

from .region import RegionFull
from .runtime import RUNTIME, CompressedRequest

#: Prompt queries whose attention scores the prompt at prefill end (snapkv's window).
DEFAULT_OBSERVATION_WINDOW = 32
#: Prompt queries attended together: bounds the [queries, heads, slots] logits.
EXTEND_QUERY_BLOCK = 256


class KvsieveAttnBackend(TorchNativeAttnBackend):
    def __init__(self, model_runner):
        super().__init__(model_runner)
        pool = self.token_to_kv_pool
        self.num_layers = pool.layer_num
        self.region = RUNTIME.ensure_region(pool.layer_num, pool.head_num, pool.head_dim, pool.dtype,
                                            self.device, pool_tokens=pool.size)

        # Token ids and the last layer's hidden states reach policies from
        # the input of the model's logits processor, which every SGLang
        # causal LM calls with (input_ids, hidden_states, lm_head, forward_batch).
        logits_processor = getattr(model_runner.model, "logits_processor", None)
        if logits_processor is not None:
            logits_processor.register_forward_pre_hook(self._observe_tokens, with_kwargs=True)

    def _observe_tokens(self, module, args, kwargs):
        if not RUNTIME.requests:
            return None
        names = ("input_ids", "hidden_states", "lm_head", "logits_metadata")
        given = dict(zip(names, args)) | kwargs
        forward_batch = given.get("logits_metadata")
        hidden = given.get("hidden_states")
        if forward_batch is None or hidden is None or not hasattr(forward_batch, "rids"):
            return None
        token_needs = Need.TOKEN_IDS | Need.HIDDEN_STATES
        lengths = (forward_batch.extend_seq_lens_cpu if forward_batch.forward_mode.is_extend()
                   else [1] * len(forward_batch.rids))
        start = 0
        for rid, n in zip(forward_batch.rids, lengths):
            req = RUNTIME.requests.get(rid)
            if req is not None and req.policy.needs & token_needs and not req.overflowed:
                rows = slice(start, start + n)
                wants_hidden = bool(req.policy.needs & Need.HIDDEN_STATES)
                req.policy.on_tokens(forward_batch.positions[rows], given["input_ids"][rows],
                                     hidden[rows] if wants_hidden else None)
            start += n
        return None

    # ----- helpers ---------------------------------------------------------
    def _prefix_kv(self, layer_id: int, req_pool_idx: int, prefix_len: int):
        slots = self.req_to_token_pool.req_to_token[req_pool_idx, :prefix_len].long()
        k = self.token_to_kv_pool.get_key_buffer(layer_id)[slots]
        v = self.token_to_kv_pool.get_value_buffer(layer_id)[slots]
        return k, v

    def _apply(self, req: CompressedRequest, layer_id: int, view, evict) -> None:
        if req.policy.keeps_slot_state:
            self.region.write_policy_state(req.rid, layer_id, view)
        if evict is not None:
            n = self.region.evict(req.rid, layer_id, evict)
            req.evicted += n
            req.eviction_events += int(n > 0)

    # ----- SGLang entry points ----------------------------------------------
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        rows = [RUNTIME.requests.get(rid) for rid in forward_batch.rids] if RUNTIME.requests else []
        if not any(rows) or layer.is_cross_attention or forward_batch.encoder_lens is not None:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        Hq, H, D = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        q3 = q.view(-1, Hq, D)
        k3, v3 = k.view(-1, H, D), v.view(-1, H, layer.v_head_dim)
        o3 = q3.new_empty((q3.shape[0], Hq, layer.v_head_dim))
        if save_kv_cache:
            # Every row's tokens go to the pool slots SGLang allocated; a
            # compressed row's private prompt slots are freed once its prefill
            # ends (plugin.free_private_prompt_slots), since only the region is read.
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
        starts = [0]
        for n in forward_batch.extend_seq_lens_cpu:
            starts.append(starts[-1] + n)
        full = [i for i, req in enumerate(rows) if req is None or req.overflowed]
        if full:
            self._extend_rows_from_pool(q3, o3, layer, forward_batch, full, starts)
        for i, req in enumerate(rows):
            if req is not None and not req.overflowed:
                span = slice(starts[i], starts[i + 1])
                o3[span] = self._extend_row(req, layer, forward_batch, i, q3[span], k3[span], v3[span])
        return o3.reshape(q3.shape[0], Hq * layer.v_head_dim)

    def _extend_rows_from_pool(self, q3, o3, layer, forward_batch, rows, starts):
        """SGLang's own extend attention for the uncompressed rows."""
        idx = torch.tensor(rows, dtype=torch.int64, device=q3.device)
        tokens = torch.cat([torch.arange(starts[i], starts[i + 1], device=q3.device) for i in rows])
        out = q3.new_empty((tokens.numel(), q3.shape[1], o3.shape[2]))
        window = layer.sliding_window_size
        self._run_sdpa_forward_extend(
            q3[tokens], out,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices[idx], forward_batch.seq_lens[idx],
            forward_batch.extend_prefix_lens[idx], forward_batch.extend_seq_lens[idx], None,
            scaling=layer.scaling, enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            causal=True, is_cross_attn=False,
            sliding_window_size=window if window is not None and window > -1 else None,
        )
        o3[tokens] = out

    def _extend_row(self, req, layer, forward_batch, i, q_rows, k_rows, v_rows):
        """One chunk of a compressed request's private prompt: store its
        tokens in the region, attend over prefix + region (causal), and at the
        prompt's end let the policy select. Returns the chunk's output."""
        prefix = forward_batch.extend_prefix_lens_cpu[i]
        if req.prefix_len < 0:
            RUNTIME.begin(req, prefix)
        T = k_rows.shape[0]
        try:
            for j in range(T):
                self.region.store(req.rid, layer.layer_id, k_rows[j], v_rows[j], prefix + j)
        except RegionFull:
            RUNTIME.overflow(req)
            return q_rows.new_zeros((T, q_rows.shape[1], v_rows.shape[2]))
        last_layer = layer.layer_id == self.num_layers - 1
        if last_layer:
            req.private_seen += T
        ends_prompt = prefix + T >= req.prompt_len
        rk, rv, view = self.region.layer_slots(req.rid, layer.layer_id)
        pk, pv = self._prefix_kv(layer.layer_id, int(forward_batch.req_pool_indices[i]), req.prefix_len)
        needs = req.policy.needs & (Need.ATTENTION | Need.PV_NORM)
        window = getattr(req.policy.params, "window", DEFAULT_OBSERVATION_WINDOW)
        positions = torch.arange(prefix, prefix + T, device=q_rows.device)
        out = q_rows.new_empty((T, q_rows.shape[1], v_rows.shape[2]))
        for b in range(0, T, EXTEND_QUERY_BLOCK):
            pos = positions[b:b + EXTEND_QUERY_BLOCK]
            mask = view.valid.unsqueeze(0) & (view.position.unsqueeze(0) <= pos.view(-1, 1, 1))
            # The prompt's last `window` queries score it for the policy, in
            # whichever chunks they fall (slots only append before selection).
            observe = pos >= req.prompt_len - window
            block_needs = needs if bool(observe.any()) else Need.NONE
            o, obs = attend(q_rows[b:b + EXTEND_QUERY_BLOCK], pk, pv, rk, rv, mask, layer.scaling,
                            block_needs, observe=observe)
            out[b:b + EXTEND_QUERY_BLOCK] = o.to(out.dtype)
            if block_needs:
                req.add_prefill_observations(layer.layer_id, obs)
        if ends_prompt:
            obs = req.take_prefill_observations(layer.layer_id, view.valid.shape[1])
            budget = req.budget(layer.tp_k_head_num, device=view.valid.device)
            self._apply(req, layer.layer_id, view, req.policy.on_prefill_end(layer.layer_id, view, obs, budget))
        if last_layer:
            if ends_prompt:
                RUNTIME.shrink_reservation(req)
            RUNTIME.report(req)
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        rows = [RUNTIME.requests.get(rid) for rid in forward_batch.rids] if RUNTIME.requests else []
        if not any(rows) or layer.is_cross_attention or forward_batch.encoder_lens is not None:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        Hq, H, D = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        q3 = q.reshape(-1, Hq, D)
        k3, v3 = k.view(-1, H, D), v.view(-1, H, layer.v_head_dim)
        o3 = q3.new_empty((q3.shape[0], Hq, layer.v_head_dim))
        if save_kv_cache:
            # Compressed rows write to slot 0, SGLang's dummy slot (decode_slots.py).
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
        full = [i for i, req in enumerate(rows) if req is None]
        if full:
            self._decode_rows_from_pool(q3, o3, layer, forward_batch, full)
        for i, req in enumerate(rows):
            if req is not None:
                self._decode_row_from_region(req, q3, k3, v3, o3, layer, forward_batch, i)
        return o3.reshape(q3.shape[0], Hq * layer.v_head_dim)

    def _decode_rows_from_pool(self, q3, o3, layer, forward_batch, rows):
        """SGLang's own decode attention for the uncompressed rows."""
        idx = torch.tensor(rows, dtype=torch.int64, device=q3.device)
        out = q3.new_empty((len(rows), q3.shape[1], o3.shape[2]))
        window = layer.sliding_window_size
        self._run_sdpa_forward_decode(
            q3[idx], out,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices[idx], forward_batch.seq_lens[idx], None,
            scaling=layer.scaling, enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            causal=False, is_cross_attn=False,
            sliding_window_size=window if window is not None and window > -1 else None,
        )
        o3[idx] = out

    def _decode_row_from_region(self, req, q3, k3, v3, o3, layer, forward_batch, i):
        if req.prefix_len < 0 or req.overflowed:
            # Being aborted (region full): its output is never sent.
            o3[i] = 0
            return
        pos = int(forward_batch.seq_lens_cpu[i]) - 1
        try:
            self.region.store(req.rid, layer.layer_id, k3[i], v3[i], pos)
        except RegionFull:
            RUNTIME.overflow(req)  # the request ends with a 503
            o3[i] = 0
            return
        rk, rv, view = self.region.layer_slots(req.rid, layer.layer_id)
        pk, pv = self._prefix_kv(layer.layer_id, int(forward_batch.req_pool_indices[i]), req.prefix_len)
        out, obs = attend_decode(q3[i], pk, pv, rk, rv, view.valid, layer.scaling, req.policy.needs)
        o3[i] = out.to(o3.dtype)
        budget = req.budget(layer.tp_k_head_num, device=view.valid.device)
        evict = req.policy.on_decode_step(pos - req.prompt_len, layer.layer_id, view, obs, budget)
        self._apply(req, layer.layer_id, view, evict)
        if layer.layer_id == self.num_layers - 1:
            req.private_seen += 1
            RUNTIME.report(req)
