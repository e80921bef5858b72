/* The affinity policy's pick over many candidates in one C loop (gateway/core/policies/
   affinity_arrays.py: `pick_in_c`, beside `pick_on_arrays`, its numpy reference).

   The numpy path's cost is its calls, not their work: ~30 calls over 1,000 candidates, a few µs
   each, ~100 µs a decision on a slow day; this is one call. Every float is computed with the
   same IEEE operations in the same order as the numpy path (built with -ffp-contract=off: no
   fused multiply-add), so the two pick the same worker with the same figures, to the last bit
   (tests/gateway/test_policy_fast.py). The one transcendental, the decay of each worker's recent
   work (numpy's power may differ from libm's pow in the last bit), is computed by numpy and
   passed in. */
#include <stdint.h>

/* The columns of LoadTracker's table (gateway/core/policies/load.py; a test checks them). */
#define PENDING 0
#define INFLIGHT 1
#define REPORT_WHEN 2
#define REPORT_QUEUED 3
#define REPORT_REQUESTS 4
#define RECENT 5
#define COLUMNS 7

/* The answer's O_FIELDS fields: out[...] (affinity_arrays.Pick, in this order). */
enum { O_PICK, O_TIED, O_KEPT, O_BEST, O_NEW, O_QUEUED, O_RUNNING, O_RECENT, O_PREFILL,
       O_OVERLOAD, O_SCORE, O_FIELDS };

static inline double max2(double a, double b) { return a > b ? a : b; }  /* np.maximum */

/* cols: the candidates' rows of LoadTracker's table as columns (COLUMNS x n: cols[c * n + i]);
   decay[i]: 0.5 ** ((now - recent_when) / half-life); at[j] / saved[j]: holder j's candidate
   position (-1: not a candidate) and prompt tokens it saves; p: total, prefill, overload,
   balance, queue and in-flight weights, tie band, move_queue_tokens, now, report ttl;
   scratch: 6 * n doubles. */
void af_pick(const double *cols, const double *decay, int64_t n, const int64_t *at,
             const double *saved, int64_t k, const double *p, int64_t rr, double *scratch,
             double *out) {
    const double total = p[0], pw = p[1], ow_cfg = p[2], bw = p[3], qw = p[4], iw = p[5];
    const double tie = p[6], move_queue = p[7], now = p[8], ttl = p[9];
    double *queued = scratch, *running = scratch + n, *recent = scratch + 2 * n;
    double *prefill = scratch + 3 * n, *score = scratch + 4 * n, *balance = scratch + 5 * n;
    const double *pending = cols + PENDING * n, *inflight = cols + INFLIGHT * n;
    const double *when = cols + REPORT_WHEN * n, *rq = cols + REPORT_QUEUED * n;
    const double *rr_req = cols + REPORT_REQUESTS * n, *value = cols + RECENT * n;
    /* LoadTracker.columns, and the prompt's prefill on each (the whole prompt but on holders) */
    const double whole = max2(total - 0.0, 0.0);
    double sum = 0.0, least_recent = 0.0;
    for (int64_t i = 0; i < n; i++) {
        int fresh = now - when[i] <= ttl;
        queued[i] = fresh ? max2(pending[i], rq[i]) : pending[i];
        running[i] = fresh ? max2(inflight[i], rr_req[i]) : inflight[i];
        recent[i] = value[i] == 0.0 ? 0.0 : value[i] * decay[i];
        prefill[i] = whole;
        sum = i ? sum + recent[i] : recent[i];  /* np.cumsum(recent)[-1]: first to last */
        if (!i || recent[i] < least_recent)
            least_recent = recent[i];
    }
    for (int64_t j = 0; j < k; j++)
        if (at[j] >= 0)
            prefill[at[j]] = max2(total - saved[j], 0.0);
    double new_ = prefill[0];
    for (int64_t i = 1; i < n; i++)
        if (prefill[i] < new_)
            new_ = prefill[i];
    const double ow = total - new_ < new_ ? ow_cfg : 0.0, mean = sum / (double)n;
    double best = 0.0, least_balance = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double weighted = pw == 1.0 ? prefill[i] : pw * prefill[i];
        if (ow != 0.0) {
            double overload = mean > 0.0 ? max2(recent[i] / mean - 1.0, 0.0) : 0.0;
            weighted = weighted * (1.0 + ow * overload);
        }
        balance[i] = weighted + bw * (recent[i] - least_recent);
        score[i] = balance[i] + qw * queued[i] + iw * running[i];
        if (!i || score[i] < best)
            best = score[i];
        if (!i || balance[i] < least_balance)
            least_balance = balance[i];
    }
    /* the near-ties: least work, then queued, then recent, then the rotation */
    const double band = best + tie;
    /* the rotation's order, (i - rr) mod n, with no division a worker */
    const int64_t first = (rr % n + n) % n;
    int64_t pick = -1, tied = 0, pick_rot = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!(score[i] <= band))
            continue;
        int64_t rot = i >= first ? i - first : i - first + n;
        tied++;
        if (pick < 0 || prefill[i] < prefill[pick]
            || (prefill[i] == prefill[pick]
                && (queued[i] < queued[pick]
                    || (queued[i] == queued[pick]
                        && (recent[i] < recent[pick]
                            || (recent[i] == recent[pick] && rot < pick_rot)))))) {
            pick = i;
            pick_rot = rot;
        }
    }
    /* kept on a holder of its prefix (the least score of those with the least prefill) when
       load alone does not pay for recomputing it */
    int kept = 0;
    if (prefill[pick] > new_) {
        int64_t holder = -1;
        double holders_least = 0.0;
        for (int64_t i = 0; i < n; i++) {
            if (prefill[i] != new_)
                continue;
            if (holder < 0 || balance[i] < holders_least)
                holders_least = balance[i];
            if (holder < 0 || score[i] < score[holder])
                holder = i;
        }
        if (queued[holder] <= move_queue && holders_least <= least_balance + tie) {
            pick = holder;
            kept = 1;
        }
    }
    out[O_PICK] = (double)pick;
    out[O_TIED] = (double)tied;
    out[O_KEPT] = (double)kept;
    out[O_BEST] = best;
    out[O_NEW] = new_;
    out[O_QUEUED] = queued[pick];
    out[O_RUNNING] = running[pick];
    out[O_RECENT] = recent[pick];
    out[O_PREFILL] = prefill[pick];
    out[O_OVERLOAD] = mean > 0.0 ? max2(recent[pick] / mean - 1.0, 0.0) : 0.0;
    out[O_SCORE] = score[pick];
}
