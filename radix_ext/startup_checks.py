"""Start-up refusals: the SGLang the hooks were written against, every hook
in place, and no SGLang setting the hooks do not handle.

SGLang runs plugins' register() inside a try/except that only logs, and
applies hooks after it returns (HookRegistry.apply_hooks, which also only
logs a target it cannot resolve). So these checks run later, in the
scheduler process, from a hook on Scheduler.init_model_config (before the
model loads) and again from the attention backend's factory; an exception
there stops the engine's start with this module's message.
"""

from __future__ import annotations

import pkgutil
from importlib.metadata import version as installed_version

#: The SGLang release whose scheduler internals the hooks wrap.
PINNED_SGLANG = "0.5.17"

BACKEND = "kvsieve"


class StartupError(RuntimeError):
    """kvsieve cannot run on this SGLang or with these settings."""


def check_sglang_version(found: str | None = None) -> None:
    found = found or installed_version("sglang")
    if found != PINNED_SGLANG:
        raise StartupError(f"kvsieve: sglang {found} is installed; kvsieve's scheduler hooks are written for "
                           f"sglang=={PINNED_SGLANG} (scripts/setup.sh installs it)")


def _wrapper_chain(target: str):
    """The function now at `target` and every function it wraps (__wrapped__)."""
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    fn = getattr(owner, "__dict__", {}).get(attr, None) if isinstance(owner, type) else None
    fn = getattr(fn, "__func__", None) or getattr(owner, attr)  # classmethod/staticmethod: the function
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        yield fn
        fn = getattr(fn, "__wrapped__", None)


def _wraps_hook(fn, hook) -> bool:
    # HookRegistry's wrappers close over the hook they call.
    return any(cell.cell_contents is hook for cell in (getattr(fn, "__closure__", None) or ())
               if _cell_set(cell))


def _cell_set(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # empty cell
        return False
    return True


def unapplied_hooks(registered) -> list[str]:
    """Targets of `registered` ((target, hook) pairs) where the hook is not in
    the function SGLang now calls: unresolvable, or never wrapped."""
    missing = []
    for target, hook in registered:
        try:
            applied = any(_wraps_hook(fn, hook) for fn in _wrapper_chain(target))
        except (ImportError, AttributeError, ValueError) as exc:
            missing.append(f"{target} ({type(exc).__name__}: {exc})")
            continue
        if not applied:
            missing.append(f"{target} (not wrapped)")
    return missing


def check_hooks_applied(registered) -> None:
    missing = unapplied_hooks(registered)
    if missing:
        raise StartupError(f"kvsieve: {len(missing)} of {len(registered)} SGLang hooks did not apply, so "
                           f"compressed requests would be mis-scheduled: {'; '.join(missing)}. "
                           f"Is sglang=={PINNED_SGLANG} installed?")


def uses_kvsieve_backend(server_args) -> bool:
    return BACKEND in (server_args.attention_backend, server_args.prefill_attention_backend,
                       server_args.decode_attention_backend)


def unsupported_settings(server_args, model_config) -> list[str]:
    """Settings that the hooks do not handle, each naming the setting."""
    from sglang.srt.configs.model_config import AttentionArch

    found = []
    if server_args.page_size not in (None, 1):
        # decode_slots.py hands compressed rows slot 0 and frees single slots.
        found.append(f"page_size={server_args.page_size} (only 1 is supported)")
    if server_args.enable_mixed_chunk:
        found.append("enable_mixed_chunk (decode rows inside a prefill batch)")
    if server_args.speculative_algorithm:
        found.append(f"speculative_algorithm={server_args.speculative_algorithm} (speculative decoding)")
    if getattr(server_args, "disaggregation_mode", "null") not in (None, "null"):
        found.append(f"disaggregation_mode={server_args.disaggregation_mode}")
    if model_config.attention_arch == AttentionArch.MLA:
        found.append(f"MLA attention (model {model_config.hf_config.architectures[0]})")
    if getattr(model_config, "is_hybrid_swa", False):
        found.append(f"sliding-window attention layers (model {model_config.hf_config.architectures[0]})")
    return found


def check_settings(server_args, model_config) -> None:
    found = unsupported_settings(server_args, model_config)
    if found:
        raise StartupError(f"kvsieve: attention backend '{BACKEND}' does not support: {'; '.join(found)}. "
                           "Change these settings or use another attention backend.")


def check_sliding_window_layers(model) -> None:
    """Models whose layers attend over a window (set on each RadixAttention,
    whatever the config calls it): the region keeps tokens past the window."""
    from sglang.srt.layers.radix_attention import RadixAttention

    windowed = sorted({m.layer_id for m in model.modules()
                       if isinstance(m, RadixAttention) and (m.sliding_window_size or -1) > 0})
    if windowed:
        raise StartupError(f"kvsieve: attention backend '{BACKEND}' does not support sliding-window attention "
                           f"layers (layers {windowed[:8]}{'...' if len(windowed) > 8 else ''} of "
                           f"{type(model).__name__}); use another attention backend")


def check_scheduler_start(scheduler, registered) -> None:
    """Everything checkable once the scheduler knows its model config."""
    check_sglang_version()
    check_hooks_applied(registered)
    if uses_kvsieve_backend(scheduler.server_args):
        check_settings(scheduler.server_args, scheduler.model_config)
