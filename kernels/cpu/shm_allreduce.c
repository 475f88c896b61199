/* All-reduce and all-gather of float32 vectors between the tensor-parallel ranks of one machine,
 * through a shared memory segment all of them map (vLLM's CPU backend does the same: gloo's
 * socket round trips cost about a millisecond each on a loaded machine, and a decode step makes
 * two per layer).
 *
 * The segment, of shm_segment_bytes(world, chunk): a header (per rank its sequence number and
 * pid, a cache line each), then two sets of ``world`` slots of ``chunk`` bytes. A collective goes
 * through the slots ``chunk`` bytes at a time; round s of the process uses slot set s % 2:
 *   1. wait until every rank has started round s - 1 (so all have finished reading round s - 2,
 *      the last user of this set);
 *   2. copy this rank's part into its slot, publish s as its sequence number (release);
 *   3. wait until every rank has published s (acquire);
 *   4. all-reduce: the sum over the slots in rank order (the same order on every rank, so every
 *      rank gets the same bits); all-gather: every slot copied out.
 * A wait spins, yielding the CPU now and then (the ranks may share cores), and checks every so
 * often that the ranks it waits for are alive: a dead one fails the collective (-1) instead of
 * hanging its peers. */
#define _GNU_SOURCE
#include <errno.h>
#include <immintrin.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#define SHM_LINE 64
#define SHM_SPIN_YIELD 64          /* spins between two sched_yield */
#define SHM_SPIN_CHECK 4096        /* yields between two checks that the peers are alive */

typedef struct {
    volatile int64_t seq;
    int64_t pid;
    char pad[SHM_LINE - 2 * sizeof(int64_t)];
} shm_rank_t;

int64_t shm_segment_bytes(int64_t world, int64_t chunk) {
    return world * (int64_t)sizeof(shm_rank_t) + 2 * world * chunk;
}

static shm_rank_t *shm_ranks(void *base) { return (shm_rank_t *)base; }

static char *shm_slot(void *base, int64_t world, int64_t chunk, int64_t set, int64_t r) {
    return (char *)base + world * (int64_t)sizeof(shm_rank_t) + (set * world + r) * chunk;
}

/* This rank's place: its pid and no round yet (before the ranks' first collective, which a
 * barrier of the caller's separates from every rank's registration). */
void shm_register(void *base, int64_t rank) {
    shm_rank_t *ranks = shm_ranks(base);
    ranks[rank].pid = (int64_t)getpid();
    __atomic_store_n(&ranks[rank].seq, 0, __ATOMIC_RELEASE);
}

/* Whether process ``pid`` is gone (or a zombie its parent has not reaped yet). */
static int shm_dead(pid_t pid) {
    if (kill(pid, 0) != 0) return errno == ESRCH;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 1;
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')');
    return p && p[1] == ' ' && p[2] == 'Z';
}

/* Wait until every rank's sequence number is at least ``seq``; -1 if one of them died. */
static int shm_wait(void *base, int64_t world, int64_t seq) {
    shm_rank_t *ranks = shm_ranks(base);
    for (int64_t r = 0; r < world; r++) {
        int64_t spins = 0;
        while (__atomic_load_n(&ranks[r].seq, __ATOMIC_ACQUIRE) < seq) {
            _mm_pause();
            if (++spins % SHM_SPIN_YIELD == 0) {
                sched_yield();
                if (spins % (SHM_SPIN_YIELD * SHM_SPIN_CHECK) == 0 && shm_dead((pid_t)ranks[r].pid))
                    return -1;
            }
        }
    }
    return 0;
}

/* One round: this rank's ``n`` bytes from ``src`` into its slot; 0 once every rank's are there. */
static int shm_round(void *base, int64_t world, int64_t rank, int64_t chunk, int64_t seq, const void *src,
                     int64_t n) {
    if (shm_wait(base, world, seq - 1) != 0) return -1;
    memcpy(shm_slot(base, world, chunk, seq % 2, rank), src, (size_t)n);
    __atomic_store_n(&shm_ranks(base)[rank].seq, seq, __ATOMIC_RELEASE);
    return shm_wait(base, world, seq);
}

/* x (n floats, in place) summed over the ranks. ``seq``: this rank's last round (updated).
 * Returns 0, or -1 when a rank died (x is then partly reduced). */
int64_t shm_all_reduce_f32(void *base, int64_t world, int64_t rank, int64_t chunk, int64_t *seq, float *x,
                           int64_t n) {
    const int64_t per = chunk / (int64_t)sizeof(float);
    for (int64_t off = 0; off < n; off += per) {
        const int64_t m = n - off < per ? n - off : per;
        const int64_t s = ++*seq;
        if (shm_round(base, world, rank, chunk, s, x + off, m * (int64_t)sizeof(float)) != 0) return -1;
        const float *slot0 = (const float *)shm_slot(base, world, chunk, s % 2, 0);
        float *out = x + off;
        memcpy(out, slot0, (size_t)(m * (int64_t)sizeof(float)));
        for (int64_t r = 1; r < world; r++) {
            const float *p = (const float *)shm_slot(base, world, chunk, s % 2, r);
            #pragma omp simd
            for (int64_t i = 0; i < m; i++) out[i] += p[i];
        }
    }
    return 0;
}

/* out (world x n bytes, rank r's at r n) gathered from every rank's x (n bytes, the same n on
 * every rank). Returns 0, or -1 when a rank died. */
int64_t shm_all_gather(void *base, int64_t world, int64_t rank, int64_t chunk, int64_t *seq, const char *x,
                       char *out, int64_t n) {
    for (int64_t off = 0; off < n; off += chunk) {
        const int64_t m = n - off < chunk ? n - off : chunk;
        const int64_t s = ++*seq;
        if (shm_round(base, world, rank, chunk, s, x + off, m) != 0) return -1;
        for (int64_t r = 0; r < world; r++)
            memcpy(out + r * n + off, shm_slot(base, world, chunk, s % 2, r), (size_t)m);
    }
    return 0;
}
