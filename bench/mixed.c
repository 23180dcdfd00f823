/* A mixed workload: N allocations of 16 bytes to 16 KiB (smaller ones likelier, as in most
   programs) into 4,096 slots chosen at random, each freeing the slot's block first: about as many
   frees as allocations, blocks living for thousands of calls. Prints the time per allocation. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define SLOTS 4096

int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 200000;
  static void *slots[SLOTS];
  unsigned long state = 1;
  struct timespec start, end;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (long i = 0; i < n; i++) {
    state = state * 6364136223846793005UL + 1442695040888963407UL;
    unsigned long r = state >> 33;
    size_t size = (size_t)16 << (r % 11); /* 16 B .. 16 KiB, each power as likely */
    size += (r >> 8) % size;               /* and anywhere up to the next power */
    size_t slot = (r >> 20) % SLOTS;
    free(slots[slot]);
    slots[slot] = malloc(size);
    *(volatile char *)slots[slot] = 1;
  }
  clock_gettime(CLOCK_MONOTONIC, &end);
  for (int i = 0; i < SLOTS; i++) free(slots[i]);
  double ns = (end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec);
  printf("ns_per_pair %.1f\n", ns / n);
  return 0;
}
