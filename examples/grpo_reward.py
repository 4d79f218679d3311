"""A verifiable toy reward for `train.objective=grpo` (README, GRPO walkthrough): the fraction of a
completion's tokens that are the letter `a` (byte 97 under the `bytes` tokenizer). A base model
almost never writes runs of it, so the mean reward starts near 0 and shows whether RL learns."""


def letter_a(row: dict, text: str, ids: list[int]) -> float:
    """row: the prompt's record ({"prompt": text}); text and ids: the completion (ids end with EOS
    when it stopped there)."""
    return sum(1 for t in ids if t == ord("a")) / max(1, len(ids))
