"""python -m posttrain.stages.launch torchrun [torchrun arguments]   (see stages/launch/wrapper.py)"""

import sys

from posttrain.stages.launch.wrapper import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
