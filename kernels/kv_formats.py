"""Quantized KV formats of the compressed region (ThinKV's TBQ, §4.2 and
appendix D.3), in PyTorch: the storage quantizes with these, the reference
attention and the tests dequantize with them; the Triton decode kernel
decodes the same bytes itself.

A quantized page holds `page_size` (16) slots of one (request, layer, kv
head) in one format. Keys are quantized per channel (one scale per channel
over the page's slots), values per token (one scale per 16 channels of a
slot), as in KIVI.

* FP8 E4M3: one code byte per element; one FP32 scale per page for the keys
  and one for the values (per-tensor scaling, the tensor being the page).
* NVFP4: E2M1 codes, two per byte (element 2j in the low nibble); one E4M3
  scale per 16 elements (per channel for keys, per 16 channels of a slot for
  values) and, as NVIDIA's format has, an FP32 scale per page that keeps the
  E4M3 scales in range.
* Ternary: {-1, 0, +1} as 2-bit codes, four per byte (00 = 0, 01 = +1,
  11 = -1, 10 = -0 read as 0); scales as NVFP4's. The threshold and scale of a
  group are TWN's: delta = 0.7 mean|x|, scale = mean of the |x| above delta.

Arrays of a page store (one row per page): codes `[pages, slots, code_bytes]`
uint8 for keys and for values (code_bytes = head_dim x class bits / 8: a page
of a narrower format uses the first bytes of its row), key scales
`[pages, head_dim]` and value scales `[pages, slots, head_dim / 16]` as E4M3
bits (uint8), the FP32 page scales `[pages, 2]` (keys, values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Format ids, ordered by precision (a page's `format` entry; 0: full precision / empty).
FULL, TERNARY, NVFP4, FP8 = 0, 1, 2, 3
BITS = {TERNARY: 2, NVFP4: 4, FP8: 8}
NAMES = {FULL: "full", TERNARY: "ternary", NVFP4: "nvfp4", FP8: "fp8"}
#: Elements sharing one E4M3 scale (NVFP4, ternary).
GROUP = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
#: E2M1 magnitudes by code (3 bits; the 4th is the sign).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_TINY = 1e-30


def code_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one slot's codes (keys or values) at `bits` per element."""
    return head_dim * bits // 8


def slot_bytes(fmt: int, head_dim: int, element_size: int) -> int:
    """Bytes one slot (its key and value) holds in a format: codes, plus
    the value scales, which belong to the slot (per token)."""
    if fmt == FULL:
        return 2 * head_dim * element_size
    codes = 2 * code_bytes(head_dim, BITS[fmt])
    return codes if fmt == FP8 else codes + head_dim // GROUP


def page_bytes(fmt: int, head_dim: int) -> int:
    """Bytes a page of a format holds besides its slots: the FP32 page
    scales and, for NVFP4 and ternary, the per-channel key scales."""
    if fmt == FULL:
        return 0
    return 8 if fmt == FP8 else 8 + head_dim


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """E4M3 bits (uint8) of x, saturating at +-448."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float8_e4m3fn).to(torch.float32)


_MIDPOINTS: dict = {}


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """4-bit codes (sign << 3 | magnitude index) of x, already divided by its scale."""
    key = str(x.device)
    if key not in _MIDPOINTS:  # made once per device: no host copy in later calls
        grid = torch.tensor(E2M1_GRID, dtype=torch.float32)
        _MIDPOINTS[key] = ((grid[1:] + grid[:-1]) / 2).to(x.device)
    index = torch.bucketize(x.abs().clamp(max=E2M1_MAX), _MIDPOINTS[key])
    return (index | ((x < 0).to(torch.int64) << 3)).to(torch.uint8)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    magnitude = grid[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def _pack(codes: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """Codes [..., D] of `bits` each into bytes [..., width] (zero padded)."""
    per_byte = 8 // bits
    c = codes.to(torch.int32).unflatten(-1, (-1, per_byte))
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    packed = (c << shifts).sum(-1).to(torch.uint8)
    pad = width - packed.shape[-1]
    return torch.nn.functional.pad(packed, (0, pad)) if pad else packed


def _unpack(packed: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    per_byte = 8 // bits
    b = packed[..., :head_dim // per_byte].to(torch.int32).unsqueeze(-1)
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    return ((b >> shifts) & ((1 << bits) - 1)).flatten(-2).to(torch.uint8)


@dataclass
class QuantPages:
    """Quantized pages as stored (one row per page)."""

    k_codes: torch.Tensor  # [N, S, CB] uint8
    v_codes: torch.Tensor  # [N, S, CB] uint8
    k_scale: torch.Tensor  # [N, D] uint8 (E4M3)
    v_scale: torch.Tensor  # [N, S, D / 16] uint8 (E4M3)
    page_scale: torch.Tensor  # [N, 2] float32 (keys, values)


def _group_scales(amax: torch.Tensor, top: float):
    """E4M3 scales of groups with magnitudes `amax` (already per group,
    divided by the largest code magnitude `top`) and the FP32 page scale that
    keeps them in E4M3's range; amax [N, ...], reduced over all but dim 0."""
    raw = amax / top
    page = (raw.flatten(1).amax(1) / E4M3_MAX).clamp(min=_TINY)  # [N]
    bits = e4m3_encode(raw / page.view(-1, *([1] * (raw.dim() - 1))))
    return bits, page


def _ternary_group(x: torch.Tensor, member: torch.Tensor, dim: int):
    """TWN threshold and scale of groups along `dim` (members only)."""
    mag = x.abs() * member
    count = member.sum(dim, keepdim=True).clamp(min=1)
    delta = 0.7 * mag.sum(dim, keepdim=True) / count
    above = ((mag > delta) & (member > 0)).float()
    alpha = (mag * above).sum(dim, keepdim=True) / above.sum(dim, keepdim=True).clamp(min=1)
    return delta, alpha


def quantize_pages(k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, fmt: torch.Tensor,
                   class_bits: int) -> QuantPages:
    """Quantize pages k, v [N, S, D] (valid [N, S]: the slots that count for
    the scales; the others get codes too, never read) each in its format
    fmt [N] (TERNARY, NVFP4 or FP8; FULL rows are encoded as NVFP4 and never
    read). Every format is computed for every page and the page's own kept:
    batched without a host sync (the pages of one call are few)."""
    N, S, D = k.shape
    width = code_bytes(D, class_bits)
    member = valid.unsqueeze(-1).float()  # [N, S, 1]
    kf, vf = k.float() * member, v.float() * member
    out_k = torch.zeros((N, S, width), dtype=torch.uint8, device=k.device)
    out_v = torch.zeros_like(out_k)
    k_scale = torch.zeros((N, D), dtype=torch.uint8, device=k.device)
    v_scale = torch.zeros((N, S, D // GROUP), dtype=torch.uint8, device=k.device)
    page_scale = torch.zeros((N, 2), dtype=torch.float32, device=k.device)

    def take(mask, codes_k, codes_v, ks, vs, ps):
        m = mask.view(-1, 1, 1)
        out_k.copy_(torch.where(m, codes_k, out_k))
        out_v.copy_(torch.where(m, codes_v, out_v))
        if ks is not None:
            k_scale.copy_(torch.where(mask.view(-1, 1), ks, k_scale))
            v_scale.copy_(torch.where(m, vs, v_scale))
        page_scale.copy_(torch.where(mask.view(-1, 1), ps, page_scale))

    if class_bits >= 8:  # FP8 (per-page FP32 scales)
        ks = (kf.abs().flatten(1).amax(1) / E4M3_MAX).clamp(min=_TINY)
        vs = (vf.abs().flatten(1).amax(1) / E4M3_MAX).clamp(min=_TINY)
        ck = e4m3_encode(kf / ks.view(-1, 1, 1))
        cv = e4m3_encode(vf / vs.view(-1, 1, 1))
        take(fmt == FP8, _pad(ck, width), _pad(cv, width), None, None, torch.stack([ks, vs], 1))
    # NVFP4: keys per channel over the slots, values per 16 channels of a slot.
    kbits, kpage = _group_scales(kf.abs().amax(1), E2M1_MAX)  # [N, D]
    vg = vf.abs().unflatten(-1, (D // GROUP, GROUP)).amax(-1)  # [N, S, D/16]
    vbits, vpage = _group_scales(vg, E2M1_MAX)
    kdec = (e4m3_decode(kbits) * kpage.view(-1, 1)).unsqueeze(1)  # [N, 1, D]
    vdec = (e4m3_decode(vbits) * vpage.view(-1, 1, 1)).repeat_interleave(GROUP, -1)  # [N, S, D]
    ck = _pack(_e2m1_codes(kf / kdec.clamp(min=_TINY)), 4, width)
    cv = _pack(_e2m1_codes(vf / vdec.clamp(min=_TINY)), 4, width)
    take(fmt == NVFP4, ck, cv, kbits, vbits, torch.stack([kpage, vpage], 1))
    # Ternary: TWN per group.
    kdelta, kalpha = _ternary_group(kf, member.expand_as(kf), 1)  # [N, 1, D]
    vgroups = vf.unflatten(-1, (D // GROUP, GROUP))
    vdelta, valpha = _ternary_group(vgroups, member.unsqueeze(-1).expand_as(vgroups), -1)  # [N, S, D/16, 1]
    kbits, kpage = _group_scales(kalpha.squeeze(1), 1.0)
    vbits, vpage = _group_scales(valpha.squeeze(-1), 1.0)
    ck = _pack(_ternary_codes(kf, kdelta), 2, width)
    cv = _pack(_ternary_codes(vgroups, vdelta).flatten(-2), 2, width)
    take(fmt == TERNARY, ck, cv, kbits, vbits, torch.stack([kpage, vpage], 1))
    return QuantPages(out_k, out_v, k_scale, v_scale, page_scale)


def _ternary_codes(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    return torch.where(x > delta, 1, torch.where(x < -delta, 3, 0)).to(torch.uint8)


def _pad(codes: torch.Tensor, width: int) -> torch.Tensor:
    pad = width - codes.shape[-1]
    return torch.nn.functional.pad(codes, (0, pad)) if pad else codes


_LUTS: dict = {}


def _lut(device) -> tuple[torch.Tensor, torch.Tensor]:
    """Values of every code byte: NVFP4 [256, 2] and ternary [256, 4]."""
    key = str(device)
    if key not in _LUTS:
        byte = torch.arange(256, dtype=torch.uint8)
        nv = _e2m1_values(_unpack(byte.view(256, 1), 4, 2))
        tern = _ternary_values(_unpack(byte.view(256, 1), 2, 4))
        _LUTS[key] = (nv.to(device), tern.to(device))
    return _LUTS[key]


def dequantize_pages(q: QuantPages, fmt: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [N, S, D] float32 of pages in formats fmt [N] (FULL rows: zeros).
    Code bytes decode through lookup tables (one gather per format)."""
    N, S, width = q.k_codes.shape
    D = head_dim
    shape = (-1, 1, 1)
    kpage, vpage = q.page_scale[:, 0].view(shape), q.page_scale[:, 1].view(shape)
    nv_lut, tern_lut = _lut(q.k_codes.device)
    kscale = (e4m3_decode(q.k_scale) * kpage.view(-1, 1)).unsqueeze(1)  # [N, 1, D]
    vscale = (e4m3_decode(q.v_scale) * vpage).repeat_interleave(GROUP, -1)  # [N, S, D]
    f = fmt.view(shape)

    def decode(codes):
        nv = nv_lut[codes[..., :D // 2].long()].flatten(-2)
        tern = tern_lut[codes[..., :D // 4].long()].flatten(-2)
        x = torch.where(f == NVFP4, nv, torch.where(f == TERNARY, tern, 0.0))
        if width >= D:  # FP8 fits this class
            x = torch.where(f == FP8, e4m3_decode(codes[..., :D].contiguous()), x)
        return x

    is_fp8 = f == FP8
    k = decode(q.k_codes) * torch.where(is_fp8, kpage, kscale)
    v = decode(q.v_codes) * torch.where(is_fp8, vpage, vscale)
    return k, v


def _ternary_values(codes: torch.Tensor) -> torch.Tensor:
    return torch.where(codes == 1, 1.0, torch.where(codes == 3, -1.0, 0.0))
