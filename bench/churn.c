/* The benchmark workload: N malloc/free pairs of 16 to 271 bytes in one thread, the loop the
   probe costs in shared/notes/probe-costs.md were measured with. Prints the time per pair. */
#include <stdio.h>

#include "churn_loop.h"

int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 200000;
  printf("ns_per_pair %.1f\n", churn(n));
  return 0;
}
