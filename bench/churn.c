/* The benchmark workload: N malloc/free pairs of 16 to 271 bytes in one thread, the loop the
   probe costs in shared/notes/probe-costs.md were measured with. Prints the time per pair. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 200000;
  struct timespec start, end;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (long i = 0; i < n; i++) {
    char *p = malloc(16 + (i & 255));
    *(volatile char *)p = 1;
    free(p);
  }
  clock_gettime(CLOCK_MONOTONIC, &end);
  double ns = (end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec);
  printf("ns_per_pair %.1f\n", ns / n);
  return 0;
}
