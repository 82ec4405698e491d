#!/usr/bin/python3
"""tools/bench-train-torch.py -- PyTorch CPU baseline of bench-train: the same Llama-family model
(hidden 512, 8 layers, 8 heads / 2 KV heads, intermediate 1536, vocab 4096, sequences of 256),
forward + backward + AdamW, in FP32 and in bf16 autocast. Called by build/bin/bench-train with
OMP/OPENBLAS/MKL thread counts set; prints one JSON line per result (same style)."""
import argparse, json, statistics, time
import torch

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--seqs", type=int, default=4)
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--json", action="store_true")
args = ap.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(0)
C, F, L, H, KV, D, V, S = 512, 1536, 8, 8, 2, 64, 4096, 256

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(torch.ones(C)), torch.nn.Parameter(torch.ones(C))
        self.q, self.k = torch.nn.Linear(C, H * D, bias=False), torch.nn.Linear(C, KV * D, bias=False)
        self.v, self.o = torch.nn.Linear(C, KV * D, bias=False), torch.nn.Linear(H * D, C, bias=False)
        self.g, self.u = torch.nn.Linear(C, F, bias=False), torch.nn.Linear(C, F, bias=False)
        self.d = torch.nn.Linear(F, C, bias=False)
    def norm(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        h = self.norm(x, self.w1)
        q = self.q(h).view(B, T, H, D).transpose(1, 2)
        k = self.k(h).view(B, T, KV, D).transpose(1, 2)
        v = self.v(h).view(B, T, KV, D).transpose(1, 2)
        rot = lambda t: torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        s = (q @ k.transpose(-1, -2)) / D ** 0.5  # torch 1.13 has no scaled_dot_product_attention
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        a = s.softmax(-1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(B, T, H * D))
        h = self.norm(x, self.w2)
        return x + self.d(torch.nn.functional.silu(self.g(h)) * self.u(h))

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, C)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(L)])
        self.wf = torch.nn.Parameter(torch.ones(C))
        self.head = torch.nn.Linear(C, V, bias=False)
    def forward(self, tok):
        pos = torch.arange(S).float()
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
        ang = torch.cat([pos[:, None] * inv[None], pos[:, None] * inv[None]], -1)
        cos, sin = ang.cos(), ang.sin()
        x = self.emb(tok)
        for b in self.blocks:
            x = b(x, cos, sin)
        x = self.wf * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        return self.head(x)

model = Model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
tok = torch.randint(0, V, (args.seqs, S))

def step(autocast):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tok)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V).float(), tok[:, 1:].reshape(-1))
    loss.backward()
    opt.step()

for name, ac in (("torch_fp32", False), ("torch_bf16_autocast", True)):
    step(ac)
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter(); step(ac); times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    rec = {"bench": "train", "impl": name, "threads": args.threads, "tokens": args.seqs * S, "median_s": med,
           "tokens_per_s": args.seqs * S / med, "runs": args.reps, "torch": torch.__version__}
    print(json.dumps(rec) if args.json else "  ".join(f"{k}={v}" for k, v in rec.items()), flush=True)
