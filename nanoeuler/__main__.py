"""`python -m nanoeuler` is `nanoeuler`."""
import sys

from .cli import main

sys.exit(main())
