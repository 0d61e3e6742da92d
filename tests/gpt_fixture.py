"""A reader's GPT for the serving command's tests: the book's GPT class at a tiny size, with seeded weights drawn
wider than GPT-2's init (so that the greedy tokens depend on the context)."""
import torch

from optlab.core.gpt.transformer import GPT, GPTConfig


def tiny_gpt(vocab_size: int = 65, block_size: int = 64) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=64))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.3)
    return model.eval()
