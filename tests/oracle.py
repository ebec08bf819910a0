"""An independent, deliberately naive single-sequence decoder: docs/algorithms.md §1, §2, §5 written
as plain Python loops over a stock transformers model (LlamaModel / Qwen2Model run with a
non-causal mask). The engine must match it token for token."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaModel, Qwen2Config, Qwen2Model

from models import checkpoint_names


def stock_model(model):
    """The stock transformers model holding `model`'s weights (LLaDA -> Llama names, Dream -> Qwen2)."""
    c = model.config
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  rope_theta=c.rope_theta, rms_norm_eps=c.rms_eps, head_dim=c.head_dim,
                  max_position_embeddings=c.max_length)
    if c.family == "dream":
        hf = Qwen2Model(Qwen2Config(**common))
    else:
        hf = LlamaModel(LlamaConfig(attention_bias=c.qkv_bias, **common))
    names = checkpoint_names(c.replace(family="dream" if c.family != "pangu" else "pangu"))
    sd = model.state_dict()
    hf_sd = {v.removeprefix("model."): sd[k].float() for k, v in names.items() if k != "output.weight"}
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    head = (model.tok_embeddings.weight if model.output is None else model.output.weight).float()
    return hf.eval(), head


def _predict(hf, head, cfg, x, mask_2d=None):
    ids = torch.tensor([x])
    n = len(x)
    mask = torch.ones(1, 1, n, n, dtype=torch.bool) if mask_2d is None else mask_2d[None, None]
    with torch.no_grad():
        h = hf(input_ids=ids, attention_mask=mask).last_hidden_state[0]
    logits = (h @ head.T).float()
    if cfg.logit_shift:
        logits = torch.cat((logits[:1], logits[:-1]), 0)     # prediction for i read at i - 1
    logits[:, cfg.mask_token_id] = float("-inf")
    p = torch.softmax(logits, -1)
    conf, tok = p.max(-1)
    return tok.tolist(), conf.tolist()


def decode(hf, head, cfg, prompt, method, gen_length, block_length, tau=0.9, steps=None, kappa=0.9, window=4):
    """Returns (generated ids up to and including the stop token, calls)."""
    M = cfg.mask_token_id
    x = list(prompt) + [M] * gen_length
    P, calls = len(prompt), 0
    nblocks = gen_length // block_length
    steps_per_block = (steps or gen_length) // nblocks
    for b in range(nblocks):
        lo, hi = P + b * block_length, P + (b + 1) * block_length
        t = 0
        while any(x[i] == M for i in range(lo, hi)):
            tok, conf = _predict(hf, head, cfg, x)
            calls += 1
            masked = [i for i in range(lo, hi) if x[i] == M]
            best = max(masked, key=lambda i: (conf[i], -i))          # ties -> lower index
            if method == "greedy":
                chosen = [best]
            elif method == "confidence":
                chosen = [i for i in masked if conf[i] >= tau] or [best]
            elif method == "topk":
                base, rem = divmod(block_length, steps_per_block)
                k = max(1, base + (1 if t < rem else 0))
                chosen = sorted(masked, key=lambda i: (-conf[i], i))[:k]
            elif method == "localleap":
                anchors = [i for i in masked if conf[i] >= kappa]
                near = [i for i in masked if conf[i] >= tau and any(abs(i - a) <= window for a in anchors)]
                chosen = sorted(set(anchors) | set(near)) or [best]
            else:
                raise ValueError(method)
            for i in chosen:
                x[i] = tok[i]
            t += 1
            for e in range(lo, hi):      # stop: a committed stop token with nothing masked before it
                if x[e] == M:
                    break
                if x[e] in cfg.stop_token_ids:
                    return x[P:e + 1], calls
    return x[P:], calls
