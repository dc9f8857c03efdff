"""kvsieve's attention backend (SGLang registry name "kvsieve").

Rows of requests without a compressing policy take SGLang's torch_native path
unchanged. For a compressed request the backend also keeps its private tokens
(the prompt tail past the radix-matched prefix, and every generated token) in
the compressed region, and its decode attention reads the shared prefix from
SGLang's token pool plus the region's retained slots, with one softmax over
both (kernels.attention_ref). The policy then decides evictions from the
observations of that same pass.

Integration step 1 of docs/design/radix_ext-integration.md: SGLang's token
pool still holds a compressed request's tokens as well (and the parent
decode attention still runs for its row, its output then replaced), so the
policies act on what attention sees but do not yet save pool memory; that
is steps 2-4 (no decode slots, admission by the compressed ceiling).
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

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
                req.prefill_done = True
        if last_layer:
            RUNTIME.report(req)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        o = super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        if not RUNTIME.requests or layer.is_cross_attention:
            return o
        Hq, H, D = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        q3 = q.reshape(-1, Hq, D)
        k3, v3 = k.view(-1, H, D), v.view(-1, H, layer.v_head_dim)
        o3 = o.view(-1, Hq, layer.v_head_dim)
        for i, rid in enumerate(forward_batch.rids):
            req = RUNTIME.requests.get(rid)
            if req is None or req.prefix_len < 0 or req.overflowed:
                continue
            pos = int(forward_batch.seq_lens_cpu[i]) - 1
            try:
                self.region.store(rid, layer.layer_id, k3[i], v3[i], pos)
            except RegionFull:
                RUNTIME.overflow(req)  # this row keeps SGLang's output; the request ends with a 503
                continue
            rk, rv, view = self.region.layer_slots(rid, layer.layer_id)
            pk, pv = self._prefix_kv(layer.layer_id, int(forward_batch.req_pool_indices[i]), req.prefix_len)
            out, obs = attend_decode(q3[i], pk, pv, rk, rv, view.valid, layer.scaling, req.policy.needs)
            o3[i] = out.to(o3.dtype)
            budget = req.budget(H)
            evict = req.policy.on_decode_step(pos - req.prompt_len, layer.layer_id, view, obs, budget)
            self._apply(req, layer.layer_id, view, evict)
            if layer.layer_id == self.num_layers - 1:
                req.private_seen += 1
                RUNTIME.report(req)
        return o
