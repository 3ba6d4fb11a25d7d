import os
import sys

# The parity helpers (tests/parity.py) are imported by name from the test modules.
sys.path.insert(0, os.path.dirname(__file__))
