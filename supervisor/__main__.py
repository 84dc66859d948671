from supervisor.cli import main
import sys

sys.exit(main())
