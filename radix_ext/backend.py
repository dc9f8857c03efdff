"""kvsieve's attention backend (SGLang registry name "kvsieve").

Rows of requests without a compressing policy take SGLang's torch_native path
unchanged. For a compressed request the backend also keeps its private tokens
(the prompt tail past the radix-matched prefix, and every generated token) in
the compressed region, and its decode attention reads the shared prefix from
SGLang's token pool plus the region's retained slots, with one softmax over
both (kernels.attention_ref). The policy then decides evictions from the
observations of that same pass.

Generated tokens of a compressed request take no token-pool slot
(decode_slots.py): their K/V exist only in the region. The private prompt is
still prefilled through the pool and kept there until the request ends, and
admission still reserves max_new_tokens (steps 2 and 4 of
docs/design/radix_ext-integration.md).
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from kvsieve.kernels.attention_ref import attend_decode
from kvsieve.policies import LayerObservations, Need

from .region import RegionFull
from .runtime import RUNTIME, CompressedRequest

#: Prompt queries whose attention scores the prompt at prefill end (snapkv's window).
DEFAULT_OBSERVATION_WINDOW = 32


class KvsieveAttnBackend(TorchNativeAttnBackend):
    def __init__(self, model_runner):
        super().__init__(model_runner)
        pool = self.token_to_kv_pool
        self.num_layers = pool.layer_num
        self.region = RUNTIME.ensure_region(pool.layer_num, pool.head_num, pool.head_dim, pool.dtype,
                                            self.device, pool_tokens=pool.size)

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

    def _prefill_observations(self, req, layer, q_rows, positions, req_pool_idx):
        """Attention mass / |p v| of the prompt's last queries over the region."""
        needs = req.policy.needs & (Need.ATTENTION | Need.PV_NORM)
        rk, rv, view = self.region.layer_slots(req.rid, layer.layer_id)
        obs = LayerObservations()
        if not needs:
            return view, obs
        pk, pv = self._prefix_kv(layer.layer_id, req_pool_idx, req.prefix_len)
        window = getattr(req.policy.params, "window", DEFAULT_OBSERVATION_WINDOW)
        for q_row, pos in list(zip(q_rows, positions))[-window:]:
            causal = view.valid & (view.position <= pos)
            _, step_obs = attend_decode(q_row, pk, pv, rk, rv, causal, layer.scaling, needs)
            for name in ("attention", "pv_norm"):
                value = getattr(step_obs, name)
                if value is not None:
                    current = getattr(obs, name)
                    setattr(obs, name, value if current is None else current + value)
        return view, obs

    # ----- SGLang entry points ----------------------------------------------
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        o = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if not RUNTIME.requests or layer.is_cross_attention:
            return o
        H, D = layer.tp_k_head_num, layer.qk_head_dim
        k3, v3 = k.view(-1, H, D), v.view(-1, H, layer.v_head_dim)
        q3 = q.view(-1, layer.tp_q_head_num, D)
        start = 0
        for i, rid in enumerate(forward_batch.rids):
            ext = forward_batch.extend_seq_lens_cpu[i]
            req = RUNTIME.requests.get(rid)
            if req is not None and not req.overflowed:
                self._extend_row(req, layer, forward_batch, i, q3[start:start + ext], k3[start:start + ext], v3[start:start + ext])
            start += ext
        return o

    def _extend_row(self, req, layer, forward_batch, i, q_rows, k_rows, v_rows):
        prefix = forward_batch.extend_prefix_lens_cpu[i]
        if req.prefix_len < 0:
            RUNTIME.begin(req, prefix)
        positions = list(range(prefix, prefix + k_rows.shape[0]))
        stored = 0
        try:
            for j, pos in enumerate(positions):
                if pos >= req.prefix_len:
                    self.region.store(req.rid, layer.layer_id, k_rows[j], v_rows[j], pos)
                    stored += 1
        except RegionFull:
            RUNTIME.overflow(req)
            return
        last_layer = layer.layer_id == self.num_layers - 1
        if last_layer:
            req.private_seen += stored
        if positions and positions[-1] + 1 >= req.prompt_len:  # this chunk ends the prompt
            req_pool_idx = int(forward_batch.req_pool_indices[i])
            view, obs = self._prefill_observations(req, layer, q_rows, positions, req_pool_idx)
            budget = req.budget(layer.tp_k_head_num)
            self._apply(req, layer.layer_id, view, req.policy.on_prefill_end(layer.layer_id, view, obs, budget))
        if last_layer:
            RUNTIME.report(req)

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
        budget = req.budget(layer.tp_k_head_num)
        evict = req.policy.on_decode_step(pos - req.prompt_len, layer.layer_id, view, obs, budget)
        self._apply(req, layer.layer_id, view, evict)
        if layer.layer_id == self.num_layers - 1:
            req.private_seen += 1
            RUNTIME.report(req)
