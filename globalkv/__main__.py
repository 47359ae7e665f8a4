import sys

from globalkv.cli import main

sys.exit(main())
