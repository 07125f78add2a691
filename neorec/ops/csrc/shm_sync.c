/* Sequence counters in memory shared by the processes of one host (neorec.distributed.shm).
 *
 * A rank publishes "collective s is written" / "collective s is read" by storing s with release
 * order; a waiter loads with acquire order, so everything written before the store is visible
 * after the load. Waiting spins briefly (a peer that is already in the collective arrives within
 * microseconds), then yields the core, then sleeps in short naps, so ranks that outnumber the
 * cores do not starve each other. */
#include <sched.h>
#include <stdint.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SHM_PAUSE() _mm_pause()
#else
#define SHM_PAUSE() ((void)0)
#endif

void shm_store(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

int64_t shm_load(int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

static double shm_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Wait until base[i * stride] >= v for every i in [0, n) but skip. Returns -1 when all have,
 * else the first index still below v after timeout_s seconds. */
int64_t shm_wait_all_ge(int64_t *base, int64_t n, int64_t stride, int64_t skip, int64_t v,
                        double timeout_s) {
  double start = -1.0;
  int64_t spins = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i == skip) continue;
    int64_t *p = base + i * stride;
    while (__atomic_load_n(p, __ATOMIC_ACQUIRE) < v) {
      ++spins;
      if (spins < 4096) {
        SHM_PAUSE();
        continue;
      }
      if (start < 0.0) start = shm_now();
      double waited = shm_now() - start;
      if (waited > timeout_s) return i;
      if (waited < 0.002) {
        sched_yield();
      } else {
        struct timespec nap = {0, 20000};
        nanosleep(&nap, NULL);
      }
    }
  }
  return -1;
}
