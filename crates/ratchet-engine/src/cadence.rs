//! When a schedule's slots fall: cron expressions (5 fields, or 6 with seconds first) in an
//! IANA time zone, or a fixed interval at the multiples of `every_ms` since the Unix epoch.
//! This is where calendars and time zones live, so that the core is handed plain `Millis`
//! (`ratchet_core::schedule`). Cron slots are whole seconds.

use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;
use croner::parser::{CronParser, Seconds, Year};
use ratchet_core::Millis;
use ratchet_core::schedule::{MAX_CATCH_UP, MIN_EVERY_MS};

/// A schedule's cadence, checked and ready to compute slots.
#[derive(Debug, Clone)]
pub enum Cadence {
    Cron { cron: Box<croner::Cron>, zone: Tz },
    Every { ms: i64 },
}

/// The due slots of a pass: the latest ones (at most `MAX_CATCH_UP`, in time order) and, when
/// there are more, the first and last of those before them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Due {
    pub earlier: Option<(Millis, Millis)>,
    pub latest: Vec<Millis>,
}

impl Cadence {
    /// Checks a stored cadence; the error says what is expected and what was found.
    pub fn of(cadence: &ratchet_store::Cadence) -> Result<Cadence, String> {
        match cadence {
            ratchet_store::Cadence::Cron {
                expression,
                timezone,
            } => Cadence::cron(expression, timezone.as_deref()),
            ratchet_store::Cadence::Every { ms } => Cadence::every(*ms),
        }
    }

    pub fn every(ms: u64) -> Result<Cadence, String> {
        if ms < MIN_EVERY_MS || ms > i64::MAX as u64 / 4 {
            return Err(format!(
                "every_ms must be at least {MIN_EVERY_MS} (one second); found {ms}"
            ));
        }
        Ok(Cadence::Every { ms: ms as i64 })
    }

    pub fn cron(expression: &str, timezone: Option<&str>) -> Result<Cadence, String> {
        let fields = expression.split_whitespace().count();
        if !expression.trim_start().starts_with('@') && !(5..=6).contains(&fields) {
            return Err(format!(
                "cron must have 5 fields (minute hour day-of-month month day-of-week) or 6 \
                 (seconds first); found {fields} in {expression:?}"
            ));
        }
        let parser = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build();
        let cron = parser
            .parse(expression)
            .map_err(|e| format!("cron {expression:?} is not a valid expression: {e}"))?;
        let zone = match timezone {
            None => Tz::UTC,
            Some(name) => name.parse::<Tz>().map_err(|_| {
                format!(
                    "timezone must be an IANA time zone name such as \"Europe/Paris\" or \
                     \"UTC\"; found {name:?}"
                )
            })?,
        };
        Ok(Cadence::Cron {
            cron: Box::new(cron),
            zone,
        })
    }

    /// The first slot strictly after `t`; None for a cron expression that never matches again.
    pub fn next_after(&self, t: Millis) -> Option<Millis> {
        match self {
            Cadence::Every { ms } => Some((t.div_euclid(*ms) + 1) * ms),
            Cadence::Cron { cron, zone } => {
                let start = at_second(t.div_euclid(1000), zone)?;
                let next = cron.find_next_occurrence(&start, false).ok()?;
                Some(next.timestamp_millis())
            }
        }
    }

    /// The slots from `from` through `now`, both included (see `Due`).
    pub fn due(&self, from: Millis, now: Millis) -> Due {
        if from > now {
            return Due::default();
        }
        let bound = MAX_CATCH_UP as i64;
        match self {
            Cadence::Every { ms } => {
                let first = from.div_ceil_euclid(*ms) * ms;
                let last = now.div_euclid(*ms) * ms;
                if first > last {
                    return Due::default();
                }
                let start = first.max(last - (bound - 1) * ms);
                Due {
                    earlier: (start > first).then_some((first, start - ms)),
                    latest: (0..=(last - start) / ms).map(|k| start + k * ms).collect(),
                }
            }
            Cadence::Cron { cron, zone } => {
                let Some(end) = at_second(now.div_euclid(1000), zone) else {
                    return Due::default();
                };
                let mut backwards = cron
                    .iter_from(end, croner::Direction::Backward)
                    .map(|at| at.timestamp_millis())
                    .take_while(|slot| *slot >= from);
                let mut latest: Vec<Millis> = backwards.by_ref().take(MAX_CATCH_UP).collect();
                let before = backwards.next();
                latest.reverse();
                let earlier = before.and_then(|last| {
                    let first = self.next_after(from - 1)?;
                    Some((first, last))
                });
                Due { earlier, latest }
            }
        }
    }
}

fn at_second(seconds: i64, zone: &Tz) -> Option<DateTime<Tz>> {
    let utc = DateTime::<Utc>::from_timestamp(seconds, 0)?;
    Some(zone.from_utc_datetime(&utc.naive_utc()))
}

trait DivCeil {
    fn div_ceil_euclid(self, by: i64) -> i64;
}

impl DivCeil for i64 {
    fn div_ceil_euclid(self, by: i64) -> i64 {
        let q = self.div_euclid(by);
        if self.rem_euclid(by) == 0 { q } else { q + 1 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2024-03-01T00:00:00Z.
    const T: Millis = 1_709_251_200_000;

    #[test]
    fn an_interval_falls_on_multiples_since_the_epoch() {
        let every = Cadence::every(5_000).unwrap();
        assert_eq!(every.next_after(T), Some(T + 5_000));
        assert_eq!(every.next_after(T + 1), Some(T + 5_000));
        assert_eq!(every.next_after(T - 1), Some(T));
        let due = every.due(T, T + 12_000);
        assert_eq!(due.latest, [T, T + 5_000, T + 10_000]);
        assert_eq!(due.earlier, None);
        assert_eq!(every.due(T + 1, T + 4_999), Due::default());
    }

    #[test]
    fn a_long_backlog_keeps_the_latest_slots_and_a_range_before_them() {
        let every = Cadence::every(1_000).unwrap();
        let due = every.due(T, T + 1_000 * 1_000);
        assert_eq!(due.latest.len(), MAX_CATCH_UP);
        assert_eq!(*due.latest.last().unwrap(), T + 1_000 * 1_000);
        let first_latest = due.latest[0];
        assert_eq!(due.earlier, Some((T, first_latest - 1_000)));

        let cron = Cadence::cron("* * * * * *", None).unwrap();
        assert_eq!(cron.due(T, T + 1_000 * 1_000), due, "the same every second");
    }

    #[test]
    fn cron_takes_five_or_six_fields_and_a_time_zone() {
        let minutely = Cadence::cron("*/15 * * * *", None).unwrap();
        assert_eq!(minutely.next_after(T), Some(T + 15 * 60_000));
        let seconds = Cadence::cron("*/10 * * * * *", None).unwrap();
        assert_eq!(seconds.next_after(T + 500), Some(T + 10_000));
        // Midnight in Paris is 23:00 UTC the day before in March (UTC+1).
        let paris = Cadence::cron("0 0 * * *", Some("Europe/Paris")).unwrap();
        assert_eq!(paris.next_after(T), Some(T + 23 * 3_600_000));
        for (expression, zone, found) in [
            ("* * * *", None, "found 4"),
            ("* * * * * * *", None, "found 7"),
            ("61 * * * *", None, "not a valid expression"),
            ("* * * * *", Some("Mars/Olympus"), "IANA time zone"),
        ] {
            let error = Cadence::cron(expression, zone).unwrap_err();
            assert!(error.contains(found), "{expression}: {error}");
        }
        assert!(Cadence::every(999).unwrap_err().contains("at least 1000"));
    }

    #[test]
    fn due_cron_slots_are_every_match_between_the_bounds() {
        let cron = Cadence::cron("0 * * * * *", None).unwrap();
        let due = cron.due(T - 30_000, T + 150_000);
        assert_eq!(due.latest, [T, T + 60_000, T + 120_000]);
        assert_eq!(due.earlier, None);
        assert!(cron.due(T + 1, T + 59_999).latest.is_empty());
        assert_eq!(cron.due(T, T).latest, [T], "a slot at now is due");
    }
}
