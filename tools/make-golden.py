#!/usr/bin/python3
"""tools/make-golden.py -- writes tests/models/golden/: a tiny random Llama-family model and
PyTorch's logits, per-token logprobs, loss, every gradient and ten AdamW-step losses for it.

Independent of fp8rl: a plain PyTorch implementation of the HF Llama math (RMSNorm, rotate-half
RoPE, grouped-query causal attention per packed sequence, SwiGLU, untied lm_head).
Run with Debian's interpreter (python3-torch): /usr/bin/python3 tools/make-golden.py
Not needed at test time; the files it writes are committed.
"""
import json, os, struct, sys
import torch

torch.manual_seed(1234)
torch.set_default_dtype(torch.float32)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models", "golden")
CFG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, vocab_size=50, rms_norm_eps=1e-5, rope_theta=10000.0,
           max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.2,
           architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu")
C, F, L = CFG["hidden_size"], CFG["intermediate_size"], CFG["num_hidden_layers"]
H, KV, D, V = CFG["num_attention_heads"], CFG["num_key_value_heads"], CFG["head_dim"], CFG["vocab_size"]

def names():
    yield "model.embed_tokens.weight", (V, C)
    for i in range(L):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (C,)
        yield p + "self_attn.q_proj.weight", (H * D, C)
        yield p + "self_attn.k_proj.weight", (KV * D, C)
        yield p + "self_attn.v_proj.weight", (KV * D, C)
        yield p + "self_attn.o_proj.weight", (C, H * D)
        yield p + "post_attention_layernorm.weight", (C,)
        yield p + "mlp.gate_proj.weight", (F, C)
        yield p + "mlp.up_proj.weight", (F, C)
        yield p + "mlp.down_proj.weight", (C, F)
    yield "model.norm.weight", (C,)
    yield "lm_head.weight", (V, C)

params = {}
for n, shape in names():
    if len(shape) == 1:
        params[n] = (1.0 + 0.1 * torch.randn(shape)).requires_grad_()
    else:
        params[n] = (CFG["initializer_range"] * torch.randn(shape)).requires_grad_()

seqs = [[1, 5, 9, 13, 2, 7, 30, 41, 8, 3, 3, 17], [4, 44, 12, 0, 49, 25, 6], [11, 21, 31]]
tokens = torch.tensor([t for s in seqs for t in s])
starts = [0]
for s in seqs: starts.append(starts[-1] + len(s))
T = len(tokens)
pos = torch.tensor([i for s in seqs for i in range(len(s))])
targets = torch.full((T,), -1, dtype=torch.long)
for a, b in zip(starts[:-1], starts[1:]):
    targets[a:b - 1] = tokens[a + 1:b]
mask = (targets >= 0).float()
mask[starts[0] + 2] = 0.0  # one masked-out target, as a prompt token would be

def rmsnorm(x, w):
    var = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(var + CFG["rms_norm_eps"]))

inv_freq = 1.0 / (CFG["rope_theta"] ** (torch.arange(0, D, 2).float() / D))
ang = pos.float()[:, None] * inv_freq[None, :]
emb = torch.cat([ang, ang], -1)
cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
def rot(x):
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([-x2, x1], -1)
def rope(x): return x * cos + rot(x) * sin

allowed = torch.zeros(T, T, dtype=torch.bool)
for a, b in zip(starts[:-1], starts[1:]):
    allowed[a:b, a:b] = torch.tril(torch.ones(b - a, b - a, dtype=torch.bool))

def forward(P):
    x = P["model.embed_tokens.weight"][tokens]
    for i in range(L):
        p = f"model.layers.{i}."
        h = rmsnorm(x, P[p + "input_layernorm.weight"])
        q = (h @ P[p + "self_attn.q_proj.weight"].T).view(T, H, D)
        k = (h @ P[p + "self_attn.k_proj.weight"].T).view(T, KV, D)
        v = (h @ P[p + "self_attn.v_proj.weight"].T).view(T, KV, D)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
        s = torch.einsum("thd,shd->hts", q, k) / (D ** 0.5)
        s = s.masked_fill(~allowed[None], float("-inf"))
        a = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, H * D)
        x = x + a @ P[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, P[p + "post_attention_layernorm.weight"])
        g = h @ P[p + "mlp.gate_proj.weight"].T
        u = h @ P[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * u) @ P[p + "mlp.down_proj.weight"].T
    x = rmsnorm(x, P["model.norm.weight"])
    return x @ P["lm_head.weight"].T

def loss_of(logits):
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(1, targets.clamp(min=0)[:, None])[:, 0] * (targets >= 0)
    return -(lp * mask).sum() / mask.sum(), lp

logits = forward(params)
loss, lp = loss_of(logits)
loss.backward()

def write_st(path, tensors, meta=None):
    header, off, blobs = {}, 0, []
    if meta: header["__metadata__"] = meta
    for n, t in tensors.items():
        b = t.detach().contiguous().float().numpy().tobytes()
        header[n] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        off += len(b); blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - (8 + len(h)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h))); f.write(h)
        for b in blobs: f.write(b)

os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "config.json"), "w") as f: json.dump(CFG, f, indent=2)
write_st(os.path.join(OUT, "model.safetensors"), {n: p for n, p in params.items()})
expected = {"logits": logits, "logprobs": lp, "loss": loss.reshape(1), "mask": mask}
for n, p in params.items(): expected["grad." + n] = p.grad

# ten AdamW steps (PyTorch AdamW, clip_grad_norm_, decay on matrices only)
P2 = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
decay = [p for n, p in P2.items() if p.dim() == 2]
nodecay = [p for n, p in P2.items() if p.dim() == 1]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                        lr=3e-3, betas=(0.9, 0.999), eps=1e-8)
losses = []
for step in range(10):
    opt.zero_grad()
    l, _ = loss_of(forward(P2))
    losses.append(l.item())
    l.backward()
    torch.nn.utils.clip_grad_norm_(list(P2.values()), 1.0)
    opt.step()
expected["adamw_losses"] = torch.tensor(losses)
write_st(os.path.join(OUT, "expected.safetensors"), expected,
         {"tokens": json.dumps(tokens.tolist()), "seq_start": json.dumps(starts), "torch": torch.__version__})
print("wrote", OUT, "T =", T, "loss =", loss.item(), "losses =", losses)
