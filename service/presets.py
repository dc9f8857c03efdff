"""Named kv_policy presets: the built-in `<policy>-paper` ones below, and the
user's from a JSON file ({name: kv_policy object}) or the store.

A preset is checked when it is loaded, so a bad one stops start-up instead of
failing requests. (The shared Redis preset store comes with the scale-out
work; this file format stays its import/export format.)

Built-in names are reserved, like policy names: a presets file naming one
stops start-up, `kvsieve presets set` refuses it, and a store entry written
behind the CLI's back is ignored with a warning (service/store_cache.py). So
`rkv-paper` means the same settings on every server; to change one, start
from it (`{"preset": "rkv-paper", "budget": 512}`) or copy it under a new name.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Optional

from kvsieve.policies import KVPolicyError, parse_kv_policy, policy_names

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltinPreset:
    """A paper's configuration of one policy, with the section each setting
    comes from (listed by GET /v1/kv_policies under `builtin_presets`)."""

    kv_policy: dict
    paper: str
    #: setting ("budget", "params.buffer", ...) -> where the paper fixes it
    sources: dict[str, str]
    note: str = ""
    #: settings the paper leaves open, kept at kvsieve's defaults, and why
    open_settings: dict[str, str] = field(default_factory=dict)

    def listing(self) -> dict:
        entry = {"kv_policy": self.kv_policy, "paper": self.paper, "sources": self.sources}
        if self.open_settings:
            entry["open_settings"] = self.open_settings
        if self.note:
            entry["note"] = self.note
        return entry


_RKV = "R-KV (Cai et al., arXiv:2505.24133; its text is not among the seeds)"
_RKV_SCORING = {
    "params.buffer": "R-KV §3: decoding-time compression runs each time 128 new tokens have filled its buffer",
    "params.window": "R-KV §3 (Eq. 1-4): importance is the attention of the last alpha = 8 queries",
    "params.kernel": "R-KV's reference code: importance max-pooled over 7 positions",
    "params.lambda_mix": "R-KV §3: score = lambda * importance - (1 - lambda) * redundancy; lambda 0.1 as its "
                         "evaluation scripts set mix_lambda (its class default is 0.07)",
    "params.scoring": "R-KV §3 (Eq. 1-6): importance from the last 8 queries' attention and the redundancy's "
                      "newest-similar-key correction (docs/design/rkv-skipkv.md)",
}

BUILTIN_PRESETS: dict[str, BuiltinPreset] = {
    "rkv-paper": BuiltinPreset(
        kv_policy={"name": "rkv", "budget": 1024,
                   "params": {"buffer": 128, "window": 8, "kernel": 7, "lambda_mix": 0.1, "scoring": "paper"}},
        paper=_RKV,
        sources={"budget": "ThinKV (thinkv.txt) §5.1 and Table 2 (§6.2): R-KV run at a 1024-token budget; "
                           "R-KV's reference configuration's default budget",
                 **_RKV_SCORING},
        note="buffer 128 decides once per 128 steps: admission reserves budget + 128 slots per head.",
    ),
    "skipkv-paper": BuiltinPreset(
        kv_policy={"name": "skipkv",
                   "params": {"buffer": 128, "window": 8, "kernel": 7, "lambda_mix": 0.1, "scoring": "paper"}},
        paper="SkipKV (skipkv-slides.txt: slides, no paper text); its token score is R-KV's",
        sources={key: f"slides 'Final Eviction Score' (sigma * I_alpha - (1 - sigma) * R: R-KV's score); {why}"
                 for key, why in _RKV_SCORING.items()},
        open_settings={"budget": "the slides sweep budgets: the request's, else the server's default",
                       "params.tau": "the slides give no value for tau: kvsieve's 0.9",
                       "params.steering": "off: it needs `kvsieve calibrate skipkv` for the model; "
                                          "{\"preset\": \"skipkv-paper\", \"params\": {\"steering\": true}} "
                                          "adds the slides' adaptive steering"},
    ),
    "thinkv-paper": BuiltinPreset(
        kv_policy={"name": "thinkv", "budget": 1024,
                   "params": {"refresh": 128, "retention": [64, 32, 16, 8, 4], "tbq": True,
                              "tbq_precision": "R4E4T2"}},
        paper="ThinKV (thinkv.txt)",
        sources={"budget": "§6.2, Table 2: a 1024-token budget with R4E4T2",
                 "params.refresh": "§4.1 (a refresh interval of tau = 128 steps) and §6.1 Hyperparameters",
                 "params.retention": "§4.3 (R = {64, 32, 16, 8, 4}, at least 4 tokens per segment) and §6.1",
                 "params.tbq": "§4.2 (TBQ) with TBE, §4.3: the hybrid scheme",
                 "params.tbq_precision": "§6.1 Hyperparameters: R and E in 4 bits, T in 2 (§4.2 allows R in 8)"},
        open_settings={"params.layers, params.thresholds": "from the model's calibration artifact (§4.1, "
                                                           "appendix D.1: |L*| = 4), else the logged fallback"},
    ),
    "crystal_kv-paper": BuiltinPreset(
        kv_policy={"name": "crystal_kv", "budget": 1024,
                   "params": {"decay": 0.6, "top_p": 0.9, "evict_interval": 1, "adaptive": True,
                              "answer_tokens": None}},
        paper="Crystal-KV (crystal-kv.txt)",
        sources={"budget": "§6.3, Table I: a fixed budget of 1024 KV entries per head",
                 "params.decay": "§6.4: lambda 0.5-0.7 recommended; accuracy peaks at 0.6-0.7 (code) and "
                                 "0.5-0.6 (math)",
                 "params.top_p": "§6.4: top-p = 0.9 recommended",
                 "params.evict_interval": "§5.2, Algorithm 1: hit test, CRF update and eviction at every step",
                 "params.adaptive": "§5.3, Algorithm 2: adaptive layer and head budgets (full Crystal-KV, "
                                    "not Lite)",
                 "params.answer_tokens": "§4 and §5.2: compression runs in the think stage only; the answer "
                                         "stage attends to what was retained, nothing more is evicted"},
        open_settings={"params.realloc_interval": "§5.3 says Algorithm 2 is 'periodically triggered' without "
                                                  "a period: kvsieve's 128 steps",
                       "params.min_head_budget": "not in the paper: kvsieve's floor of 16 per head",
                       "params.think_end": "the models' end-of-think marker, </think> (DeepSeek-R1 distills, §6.1)"},
        note="answer_tokens null: admission reserves each head's whole generation (nothing is evicted after "
             "</think>).",
    ),
    "crystalcache-paper-b30": BuiltinPreset(
        kv_policy={"name": "crystalcache", "budget_ratio": 0.3,
                   "params": {"sinks": 4, "recent": 128, "decode": False}},
        paper="CrystalCache (crystalcache.txt)",
        sources={"budget_ratio": "§4.4, Eq. 41: beta in {0.3, 0.5}; B = max(N_sink + W_recent, ceil(beta * n)) "
                                 "(§3.7, Eq. 30) = max(132, ceil(0.3 n)) at the prompt's end",
                 "params.sinks": "Table 2 (§3.1): N_sink = 4",
                 "params.recent": "Table 2 (§3.1): W_recent = 128",
                 "params.decode": "§3.1 and §3.8: the evaluated configuration decodes from the prefill-"
                                  "compressed cache; the breath cycles are dormant in the paper"},
        note="n is the private prompt (a prefix shared through the radix cache is not counted). The other "
             "Table 2 values (C, k, tau, T_max 32, tau_merge 0.3, alpha 1) are the policy's fixed defaults.",
    ),
}
# beta 0.5: the same configuration at the paper's other budget. Two presets
# rather than one with a default: the paper reports every result at both and
# names neither its default.
BUILTIN_PRESETS["crystalcache-paper-b50"] = BuiltinPreset(
    kv_policy={**BUILTIN_PRESETS["crystalcache-paper-b30"].kv_policy, "budget_ratio": 0.5},
    paper=BUILTIN_PRESETS["crystalcache-paper-b30"].paper,
    sources={**BUILTIN_PRESETS["crystalcache-paper-b30"].sources,
             "budget_ratio": "§4.4, Eq. 41: beta in {0.3, 0.5}; B = max(N_sink + W_recent, ceil(beta * n)) "
                             "(§3.7, Eq. 30) = max(132, ceil(0.5 n)) at the prompt's end"},
    note=BUILTIN_PRESETS["crystalcache-paper-b30"].note,
)
_LONGFLOW_SOURCES = {
    "params.window": "§4.1: a prompt over the budget is first cut to it with SnapKV; the window is SnapKV's "
                     "default (32), LongFlow gives none",
    "params.kernel": "§4.1 (SnapKV's cut): SnapKV's default pooling width 7, LongFlow gives none",
    "params.protect_recent": "§3.2-3.4: only the current token is protected; no auxiliary state",
}
BUILTIN_PRESETS["longflow-paper"] = BuiltinPreset(
    kv_policy={"name": "longflow", "budget": 3200, "params": {"window": 32, "kernel": 7, "protect_recent": 0}},
    paper="LongFlow (longflow.txt)",
    sources={"budget": "§4.1: budgets of 3,200 and 2,400 tokens for 16K-token generations; §4.4 measures "
                       "throughput at 3,200 (80% compression)",
             **_LONGFLOW_SOURCES},
    note="longflow-paper-2400 is the paper's tighter budget.",
)
BUILTIN_PRESETS["longflow-paper-2400"] = BuiltinPreset(
    kv_policy={**BUILTIN_PRESETS["longflow-paper"].kv_policy, "budget": 2400},
    paper="LongFlow (longflow.txt)",
    sources={"budget": "§4.1 and Table 1: the 2,400-token budget", **_LONGFLOW_SOURCES},
)


def builtin_presets() -> dict[str, dict]:
    """{name: kv_policy} of the built-ins (copies: callers may not change them)."""
    return {name: json.loads(json.dumps(p.kv_policy)) for name, p in BUILTIN_PRESETS.items()}


def builtin_listing(served: Collection[str]) -> dict[str, dict]:
    """The built-ins of the policies this engine serves, with their sources."""
    return {name: p.listing() for name, p in sorted(BUILTIN_PRESETS.items()) if p.kv_policy["name"] in served}


def usable_builtins() -> dict[str, dict]:
    """The built-ins that validate here. One that does not (a policy module
    or parameter this build lacks) is left out with a warning, so it cannot
    stop the server; tests/test_paper_presets.py checks that all validate."""
    usable = {}
    for name, value in builtin_presets().items():
        try:
            parse_kv_policy(value, field=f"presets.{name}")
        except KVPolicyError as exc:
            logger.warning("built-in preset %r is not served: %s", name, exc)
            continue
        usable[name] = value
    return usable


def validate_presets(presets: dict[str, Any]) -> dict[str, dict]:
    checked: dict[str, dict] = {}
    for name, value in presets.items():
        if name in policy_names():
            raise ValueError(f"preset {name!r} has the name of a policy")
        if name in BUILTIN_PRESETS:
            raise ValueError(f"preset {name!r} has the name of a built-in preset (built-ins: "
                             f"{', '.join(sorted(BUILTIN_PRESETS))}); start from it with "
                             f'{{"preset": "{name}", ...}} or give yours another name')
        if not isinstance(value, dict):
            raise ValueError(f"preset {name!r} must be a kv_policy object")
        try:
            parse_kv_policy(value, field=f"presets.{name}")
        except KVPolicyError as exc:
            raise ValueError(f"invalid preset: {exc}") from None
        checked[name] = value
    return checked


def load_presets(path: Optional[str | Path]) -> dict[str, dict]:
    """The built-in presets and the file's (checked; a file naming a
    built-in is an error)."""
    if path is None:
        return usable_builtins()
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: presets must be a JSON object {{name: kv_policy}}")
    return {**usable_builtins(), **validate_presets(data)}
