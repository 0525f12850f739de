"""A load client process: `python -m kipp_core.loadgen FD`, FD a socket to the runner."""

import sys
from multiprocessing.connection import Connection

from kipp_core.loadgen.driver import client_process

client_process(Connection(int(sys.argv[1])))
