/* The benchmark workload: N malloc/free pairs of 16 to 271 bytes in each of THREADS threads (1 by
   default), the loop the probe costs in shared/notes/probe-costs.md were measured with. Prints
   the time per pair, the mean of the threads' own. */
#include <pthread.h>
#include <stdio.h>

#include "churn_loop.h"

static long pairs;

static void *run(void *result) {
  *(double *)result = churn(pairs);
  return NULL;
}

int main(int argc, char **argv) {
  pairs = argc > 1 ? atol(argv[1]) : 200000;
  int threads = argc > 2 ? atoi(argv[2]) : 1;
  if (pairs < 1 || threads < 1 || threads > 64) return 2;
  pthread_t ids[64];
  double ns[64], total = 0;
  for (int i = 0; i < threads; i++) pthread_create(&ids[i], NULL, run, &ns[i]);
  for (int i = 0; i < threads; i++) {
    pthread_join(ids[i], NULL);
    total += ns[i];
  }
  printf("ns_per_pair %.1f\n", total / threads);
  return 0;
}
