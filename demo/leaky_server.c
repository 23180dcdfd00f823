/* The demo's patient: a pretend server whose two worker threads handle requests. Each request
   allocates a buffer and a session; one request in ten fails, and the error path forgets to free
   its session. A cache also grows without bound. Runs until killed. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct session {
  char user[64];
  char *buffer;
};

void *cache[1 << 16]; /* not static: the compiler must keep every store */
static int cached;
static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;

__attribute__((noinline)) static struct session *open_session(int id) {
  struct session *s = calloc(1, sizeof *s);
  s->buffer = malloc(4096);
  memset(s->user, 'a' + id % 26, sizeof s->user - 1);
  return s;
}

__attribute__((noinline)) static void close_session(struct session *s) {
  free(s->buffer);
  free(s);
}

__attribute__((noinline)) static void remember(int id) {
  pthread_mutex_lock(&cache_lock);
  if (cached < (1 << 16)) {
    cache[cached] = malloc(16);
    memcpy(cache[cached++], id % 2 ? "odd request" : "even request", 13);
  }
  pthread_mutex_unlock(&cache_lock);
}

__attribute__((noinline)) static int handle_request(int id) {
  struct session *s = open_session(id);
  remember(id);
  if (id % 10 == 0) {
    free(s->buffer); /* the bug: the session itself is never freed on this error path */
    return -1;
  }
  close_session(s);
  return 0;
}

static void *worker(void *arg) {
  for (int id = (int)(long)arg;; id += 2) {
    handle_request(id);
    usleep(2000);
  }
  return NULL;
}

int main(void) {
  pthread_t threads[2];
  for (long i = 0; i < 2; i++) pthread_create(&threads[i], NULL, worker, (void *)i);
  pthread_join(threads[0], NULL);
  return 0;
}
