"""Draft training for speculative decoding: self-distilled data from the target, then Medusa heads,
an EAGLE-1/2 draft, an EAGLE-3 draft and a small draft model, each saved in the format its converter reads."""
