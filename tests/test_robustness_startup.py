"""Start-up refusals (radix_ext/startup_checks.py): SGLang settings the
hooks do not handle stop the engine's start with a message naming the
setting; so do an SGLang other than the pinned one and a hook that did not
apply (SGLang itself only logs those)."""

import json
import os
import subprocess
import sys

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

REFUSED_ENGINE = r'''
import os, sys
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"

if __name__ == "__main__":
    import sglang
    sglang.Engine(model_path=sys.argv[1], device="cpu", attention_backend="kvsieve", sampling_backend="pytorch",
                  disable_cuda_graph=True, max_total_tokens=1024, log_level="error",
                  page_size=16, enable_mixed_chunk=True)
    print("ENGINE STARTED")
'''

HOOKS = r'''
import json, os
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from kvsieve.radix_ext import plugin, startup_checks

plugin.register()
HookRegistry.apply_hooks()  # what SGLang's load_plugins does next
out = {"registered": len(plugin.REGISTERED), "unapplied": startup_checks.unapplied_hooks(plugin.REGISTERED)}
startup_checks.check_hooks_applied(plugin.REGISTERED)

# A target SGLang no longer has (a renamed method): HookRegistry logs and goes on.
def hook(original, *args, **kwargs):
    return original(*args, **kwargs)

target = "sglang.srt.managers.scheduler.Scheduler._kvsieve_renamed_method"
HookRegistry.register(target, hook, HookType.AROUND)
plugin.REGISTERED.append((target, hook))
HookRegistry.apply_hooks()
try:
    startup_checks.check_hooks_applied(plugin.REGISTERED)
    out["error"] = None
except startup_checks.StartupError as exc:
    out["error"] = str(exc)
print("RESULT " + json.dumps(out))
'''


def run_script(tmp_path, name, text, *args):
    path = tmp_path / name
    path.write_text(text)
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=600)


def test_unsupported_settings_stop_the_engine_start(tiny_llama, tmp_path):
    done = run_script(tmp_path, "refused_engine.py", REFUSED_ENGINE, str(tiny_llama))
    output = done.stdout + done.stderr
    assert "ENGINE STARTED" not in output and done.returncode != 0
    assert "attention backend 'kvsieve' does not support" in output, output[-4000:]
    assert "page_size=16" in output and "enable_mixed_chunk" in output


def test_every_hook_applies_and_one_that_does_not_is_an_error(tmp_path):
    done = run_script(tmp_path, "hooks.py", HOOKS)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads([l for l in done.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
    assert out["registered"] >= 20 and out["unapplied"] == []
    assert out["error"] is not None
    assert "Scheduler._kvsieve_renamed_method" in out["error"] and "did not apply" in out["error"]


def test_only_the_pinned_sglang_is_accepted():
    from kvsieve.radix_ext.startup_checks import StartupError, check_sglang_version

    check_sglang_version()  # the installed one is the pinned one
    with pytest.raises(StartupError, match=r"sglang 0\.5\.18 is installed.*sglang==0\.5\.17"):
        check_sglang_version("0.5.18")


def test_speculative_decoding_mla_and_sliding_windows_are_refused(tiny_llama, tmp_path):
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.server_args import ServerArgs

    from kvsieve.radix_ext.startup_checks import StartupError, check_settings, check_sliding_window_layers

    args = ServerArgs(model_path=str(tiny_llama), device="cpu", attention_backend="kvsieve")
    llama = ModelConfig(str(tiny_llama))
    check_settings(args, llama)  # the settings kvsieve serve uses pass
    # ServerArgs is read-only once resolved; this sets the one field as the
    # command line would (a real EAGLE start needs a draft model).
    object.__setattr__(args, "speculative_algorithm", "EAGLE")
    with pytest.raises(StartupError, match="speculative_algorithm=EAGLE"):
        check_settings(args, llama)
    object.__setattr__(args, "speculative_algorithm", None)

    # A DeepSeek-V2 config (multi-head latent attention); no weights needed.
    mla_dir = tmp_path / "tiny-deepseek-v2"
    mla_dir.mkdir()
    (mla_dir / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": None,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "max_position_embeddings": 2048, "torch_dtype": "float32"}))
    with pytest.raises(StartupError, match=r"MLA attention \(model DeepseekV2ForCausalLM\)"):
        check_settings(args, ModelConfig(str(mla_dir)))

    # Layers with a window, as SGLang builds them for Gemma-2 and others.
    model = torch.nn.ModuleList([
        RadixAttention(4, 16, 0.25, 2, layer_id=0, sliding_window_size=64),
        RadixAttention(4, 16, 0.25, 2, layer_id=1)])
    with pytest.raises(StartupError, match=r"sliding-window attention layers \(layers \[0\]"):
        check_sliding_window_layers(model)
    check_sliding_window_layers(torch.nn.ModuleList([RadixAttention(4, 16, 0.25, 2, layer_id=0)]))
