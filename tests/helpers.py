"""Small shared pieces for the unit tests."""
from optlab.core.knobs.profiles import Profile

TINY = Profile("tiny", ("resnet18",), batch_size=8, width=0.125, warmup_steps=1, steps=3, test_steps=2, repeats=3,
               num_workers=0)
