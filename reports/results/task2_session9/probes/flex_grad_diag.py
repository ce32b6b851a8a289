# ruff: noqa: B023, B905  (archived probe: kept as it ran; its lambdas run inside the loop)
"""Diagnose flex backward vs dense/per-document reference on CUDA."""

import sys

import torch

sys.path.insert(0, ".")
from torch.nn.attention.flex_attention import flex_attention

from effdl.ops.document_attention import (
    document_attention,
    document_block_mask,
    document_mask,
)
from tests.ops.test_document_attention import (
    packed_doc_ids,
    per_document_reference,
    qkv,
    reference_block_mask,
)

print(torch.__version__, torch.cuda.get_device_name())
cflex = torch.compile(flex_attention, dynamic=False)


def grads(fn, q, k, v):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    gq, gk, gv = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    return out.float(), gq.float(), gk.float(), gv.float()


for T in (640, 600):
    for dtype in (torch.float32, torch.bfloat16):
        lens = [[200, 50, 300, 40], [T], [1, T - 1], [128, 128, 128, 100]]
        doc_ids = packed_doc_ids(lens, T).cuda()
        q, k, v = (t.to(dtype) for t in qkv((4, 8, T, 64), torch.float32, "cuda"))
        ref = grads(
            lambda a, b, c: per_document_reference(a.double(), b.double(), c.double(), doc_ids),
            q,
            k,
            v,
        )
        mine = document_block_mask(doc_ids, 128)
        theirs = reference_block_mask(doc_ids, 128)

        def dm(doc_ids=doc_ids):
            def m(b, h, qi, ki):
                return (doc_ids[b, qi] == doc_ids[b, ki]) & (qi >= ki)

            return m

        variants = {
            "dense": lambda a, b, c: document_attention(a, b, c, document_mask(doc_ids, "dense")),
            "flex_mine": lambda a, b, c: cflex(a, b, c, block_mask=mine),
            "flex_create": lambda a, b, c: cflex(a, b, c, block_mask=theirs),
            "flex_eager_mine": lambda a, b, c: flex_attention(a, b, c, block_mask=mine),
            "flex_nomask_causal_only": None,
        }
        for name, fn in variants.items():
            if fn is None:
                continue
            try:
                got = grads(fn, q, k, v)
                errs = [
                    ((g - r).abs().max().item(), (g - r).norm().item() / r.norm().item())
                    for g, r in zip(got, ref)
                ]
                where = (got[3] - ref[3]).abs().amax(dim=(1, 3))  # per (b, token)
                bad = (where > 1e-2 * ref[3].abs().max()).nonzero()
                print(
                    f"T={T} {str(dtype)[6:]:9s} {name:16s} out/gq/gk/gv maxabs,rel:",
                    " ".join(f"{a:.2e}/{r:.1e}" for a, r in errs),
                    "bad gv tokens:",
                    bad[:8].tolist(),
                    len(bad),
                )
            except Exception as e:
                print(f"T={T} {dtype} {name}: ERROR {type(e).__name__}: {str(e)[:300]}")
