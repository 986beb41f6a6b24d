# A rank started by torchrun (not the launcher) gets the OpenMP wait policy here, before
# anything of it imports torch (wire/threads.py says why).
from wire.threads import apply_openmp_defaults

apply_openmp_defaults()
