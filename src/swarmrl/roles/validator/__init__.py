"""The validator role: the trusted checker that replays submissions and judges them."""
