"""The local queue's fork server dies with the thread that started it (the API's dispatcher).

Imported by the fork server alone, as the first module it preloads
(``LocalProcessQueue`` names it in ``set_forkserver_preload``): importing it is what it does.

Without it the fork server would outlive a killed API: it exits once every copy of its
"alive" pipe is closed, and each process it forks holds a copy (multiprocessing's design, so
that it serves the children's own children). Job processes die with the fork server
(PR_SET_PDEATHSIG, ``job_process.die_with_parent``), so a job would run on, unwatched, after
its server died. Here the fork server asks the kernel for SIGKILL when its parent thread ends,
which an API killed with -9 does too. An API that dies before this import runs leaves a fork
server with no children and its pipe closed: it exits by itself.
"""

from quant.isolation import die_with_parent

die_with_parent()
