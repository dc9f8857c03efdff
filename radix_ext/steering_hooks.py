"""skipkv's steering in SGLang's forward, from outside SGLang: a forward hook
on every decoder layer of the loaded model (PyTorch's module hooks, no patch
of SGLang's files). Installed once per scheduler process by the attention
backend's factory (plugin.py).

A hook returns at once unless a steered request lives at its layer (a host
dict lookup). Otherwise, in a decode forward (one token per row), it hands
the layer's output hidden states, the forward's input ids and req_pool rows
to policies.skipkv.steering.SteeringTable.apply: one masked add on the
device for the whole batch. Layer outputs are (hidden_states, residual) in
SGLang's decoder layers, the residual stream being their sum; α·s goes into
hidden_states, so the next layer (or the final norm) reads it.

Prefill (extend) forwards are never steered: their tokens are the prompt.
Batches with compressed rows run eagerly (plugin.graphs_skip_compressed_batches),
so a CUDA graph never holds a hook's work: graphs captured at start-up saw
no steered request.
"""

from __future__ import annotations

import logging

import torch

from kvsieve.policies.skipkv import steering

logger = logging.getLogger(__name__)


def decoder_layers(model) -> list:
    """The model's decoder layers, in order (model.model.layers in SGLang's causal LMs)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def _forward_batch(args, kwargs):
    for value in (*args, *kwargs.values()):
        if hasattr(value, "forward_mode") and hasattr(value, "req_pool_indices"):
            return value
    return None


def _hook(layer_id: int):
    def steer(module, args, kwargs, output):
        table = steering.TABLE
        if table is None or layer_id not in table.live:
            return None
        batch = _forward_batch(args, kwargs)
        if batch is None or not batch.forward_mode.is_decode():
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.dim() != 2 or hidden.shape[0] != batch.input_ids.shape[0]:
            return None  # not one token per row (padded or speculative batches): left alone
        steered = table.apply(layer_id, hidden, batch.input_ids, batch.req_pool_indices)
        return (steered, *output[1:]) if isinstance(output, tuple) else steered

    return steer


def install(model_runner) -> int:
    """Hook every decoder layer and tell the skipkv policy the engine steers;
    returns the number of layers hooked (0: this model's layers were not found)."""
    if steering.ENGINE is not None:
        return 0
    layers = decoder_layers(model_runner.model)
    if not layers:
        logger.warning("kvsieve: no decoder layers found in %s: skipkv steering is off",
                       type(model_runner.model).__name__)
        return 0
    for i, layer in enumerate(layers):
        layer.register_forward_hook(_hook(i), with_kwargs=True)
    param = next(model_runner.model.parameters())
    steering.ENGINE = steering.EngineSteering(
        rows=model_runner.req_to_token_pool.req_to_token.shape[0],
        hidden_size=int(model_runner.model_config.hidden_size),
        dtype=param.dtype, device=torch.device(model_runner.device))
    return len(layers)
