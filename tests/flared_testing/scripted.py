"""Scripted models for the API tests: tiny transformers Llamas whose greedy output is a chosen function of the
current token, so real generation through the daemon, detokenizer, parsers and templates writes known text."""

from __future__ import annotations


def script_successors(model, successors: dict[int, int]) -> None:
    """Set a transformers Llama's weights so that at temperature 0 token ``cur`` is followed by ``successors[cur]``:
    every layer's output projections zero (the residual stream stays the current token's embedding), and each next
    token's LM-head row the sum of its predecessors' unit embeddings times 10 (a logit of about 10 * sqrt(hidden) for
    a scripted pair, about 0 otherwise)."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        for nxt in set(successors.values()):
            model.lm_head.weight[nxt] = sum(10.0 * emb[cur] / emb[cur].norm()
                                            for cur, n in successors.items() if n == nxt)


def bpe_tokenizer(directory, corpus: list[str], *, special: list[str], added: list[str] = (), vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on ``corpus`` (twenty passes) with ``special`` tokens and ``added`` ones
    (matched as written), saved as ``directory``/tokenizer.json; returns it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus) * 20, trainer)
    if added:
        tok.add_tokens([AddedToken(t, normalized=False) for t in added])
    tok.save(str(directory / "tokenizer.json"))
    return tok
