"""Models shaped like the ones users train, for the tests of users' own loops: a Hugging Face-
shaped causal LM (blocks in model.model.layers, called with keyword arguments), a LoRA-wrapped
MLP, a model with an unused head, and a small mixture of experts routed by step."""

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.input_layernorm = torch.nn.LayerNorm(d)
        self.up_proj = torch.nn.Linear(d, 4 * d)
        self.down_proj = torch.nn.Linear(4 * d, d)

    def forward(self, hidden_states, attention_mask=None):
        h = self.down_proj(torch.tanh(self.up_proj(self.input_layernorm(hidden_states))))
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return hidden_states + h


class Inner(torch.nn.Module):
    """LlamaModel's shape: embeddings, a ModuleList of blocks, a final norm."""

    def __init__(self, vocab, d, n):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(hidden_states=h, attention_mask=attention_mask)
        return self.norm(h)


class CausalLm(torch.nn.Module):
    """LlamaForCausalLM's shape: model.model.layers, lm_head, a dict with the loss."""

    def __init__(self, vocab=96, d=32, n=10, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = Inner(vocab, d, n)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)
        self.vocab = vocab

    def forward(self, input_ids, labels=None, attention_mask=None):
        logits = self.lm_head(self.model(input_ids=input_ids, attention_mask=attention_mask))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.reshape(-1, self.vocab), labels.reshape(-1))
        return out


def lm_batch(step, vocab=96, device="cpu"):
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, vocab, (4, 12), generator=g)
    mask = torch.ones(4, 12)
    mask[0, -3:] = 0
    return {
        "input_ids": ids.to(device),
        "labels": ids.roll(-1, 1).to(device),
        "attention_mask": mask.to(device),
    }


class LoraLinear(torch.nn.Module):
    """A frozen base Linear plus a trainable low-rank update, as peft wraps it."""

    def __init__(self, base, r=4):
        super().__init__()
        self.base = base
        self.lora_A = torch.nn.Linear(base.in_features, r, bias=False)
        self.lora_B = torch.nn.Linear(r, base.out_features, bias=False)
        torch.nn.init.normal_(self.lora_B.weight, std=0.02)
        for p in self.base.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


class LoraMlp(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = LoraLinear(torch.nn.Linear(16, 32))
        self.mid = LoraLinear(torch.nn.Linear(32, 32))
        self.out = LoraLinear(torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; the loss uses only the first (an unused head: no gradient)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(32, 4)
        self.aux_head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.trunk(x)))


class Moe(torch.nn.Module):
    """Four experts; step k routes through experts k % 4 and (k + 1) % 4 only, so each expert
    misses half the steps (experts that are not routed get no gradient)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(16, 32)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
        self.out = torch.nn.Linear(32, 4)
        self.route = 0

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        k = self.route
        h = h + self.experts[k % 4](h) + self.experts[(k + 1) % 4](h)
        return self.out(torch.tanh(h))


class NanoGpt(torch.nn.Module):
    """nanoGPT's shape: transformer = ModuleDict(wte, wpe, h=ModuleList, ln_f), and lm_head whose
    weight is tied to wte's."""

    def __init__(self, vocab=96, d=128, n=6, block=16, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.transformer = torch.nn.ModuleDict(
            dict(
                wte=torch.nn.Embedding(vocab, d),
                wpe=torch.nn.Embedding(block, d),
                h=torch.nn.ModuleList(Block(d) for _ in range(n)),
                ln_f=torch.nn.LayerNorm(d),
            )
        )
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        self.vocab = vocab

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))
        return logits, loss
