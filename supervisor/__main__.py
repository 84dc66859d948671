import sys

from supervisor.cli.app import main

sys.exit(main())
