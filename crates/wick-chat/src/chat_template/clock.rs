//! The clock behind `strftime_now`: a calendar date and time, read from the system or fixed.
//!
//! Templates print today's date into the system prompt (Llama 3.x: `strftime_now("%d %b %Y")`,
//! Granite, gpt-oss, Mistral Small). Tests need that date fixed; the server reads the system
//! clock. The system clock is read in UTC: wick has no time-zone database, and a server's idea of
//! "today" in UTC is as good as any.

use std::time::{SystemTime, UNIX_EPOCH};

/// Where `strftime_now` gets the current date and time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current date and time, as the template should see it.
    fn now(&self) -> CivilTime;
}

/// The system clock, in UTC.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> CivilTime {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        CivilTime::from_unix_seconds(
            i64::try_from(since_epoch.as_secs()).unwrap_or(i64::MAX),
            since_epoch.subsec_micros(),
        )
    }
}

/// A clock that always reads the same time (tests, reproducible prompts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedClock(pub CivilTime);

impl Clock for FixedClock {
    fn now(&self) -> CivilTime {
        self.0
    }
}

/// A proleptic Gregorian date and a time of day, without a time zone (like Python's naive
/// `datetime`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CivilTime {
    /// Year, e.g. 2025.
    pub year: i32,
    /// Month, 1..=12.
    pub month: u32,
    /// Day of the month, 1..=31.
    pub day: u32,
    /// Hour, 0..=23.
    pub hour: u32,
    /// Minute, 0..=59.
    pub minute: u32,
    /// Second, 0..=59.
    pub second: u32,
    /// Microsecond, 0..=999_999.
    pub microsecond: u32,
}

impl CivilTime {
    /// A checked date and time; `None` when a field is out of range (the 30th of February, hour 24).
    pub fn new(
        year: i32,
        month: u32,
        day: u32,
        hour: u32,
        minute: u32,
        second: u32,
    ) -> Option<CivilTime> {
        let valid = (1..=12).contains(&month)
            && day >= 1
            && day <= days_in_month(year, month)
            && hour < 24
            && minute < 60
            && second < 60;
        valid.then_some(CivilTime {
            year,
            month,
            day,
            hour,
            minute,
            second,
            microsecond: 0,
        })
    }

    /// The UTC date and time `seconds` after 1970-01-01T00:00:00.
    pub fn from_unix_seconds(seconds: i64, microsecond: u32) -> CivilTime {
        let days = seconds.div_euclid(86_400);
        let of_day = seconds.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        CivilTime {
            year,
            month,
            day,
            hour: of_day / 3600,
            minute: of_day / 60 % 60,
            second: of_day % 60,
            microsecond: microsecond.min(999_999),
        }
    }

    /// Days since 1970-01-01.
    pub fn days_since_epoch(&self) -> i64 {
        days_from_civil(self.year, self.month, self.day)
    }

    /// Seconds since 1970-01-01T00:00:00, reading this time as UTC.
    pub fn unix_seconds(&self) -> i64 {
        self.days_since_epoch() * 86_400
            + i64::from(self.hour) * 3600
            + i64::from(self.minute) * 60
            + i64::from(self.second)
    }

    /// Day of the week, 0 = Sunday … 6 = Saturday.
    pub fn weekday_from_sunday(&self) -> u32 {
        // 1970-01-01 was a Thursday.
        (self.days_since_epoch() + 4).rem_euclid(7) as u32
    }

    /// Day of the year, 1..=366.
    pub fn day_of_year(&self) -> u32 {
        (self.days_since_epoch() - days_from_civil(self.year, 1, 1)) as u32 + 1
    }
}

fn is_leap(year: i32) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

fn days_in_month(year: i32, month: u32) -> u32 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i32, month: u32, day: u32) -> i64 {
    let year = i64::from(year) - i64::from(month <= 2);
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month = i64::from(month);
    let day_of_year = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + i64::from(day) - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// The date `days` after 1970-01-01 (inverse of [`days_from_civil`]).
fn civil_from_days(days: i64) -> (i32, u32, u32) {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (
        year.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32,
        month,
        day,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_seconds_round_trip_through_the_calendar() {
        let t = CivilTime::from_unix_seconds(1_741_944_413, 0);
        assert_eq!(t, CivilTime::new(2025, 3, 14, 9, 26, 53).unwrap());
        assert_eq!(t.unix_seconds(), 1_741_944_413);
        assert_eq!(t.weekday_from_sunday(), 5); // a Friday
        assert_eq!(t.day_of_year(), 73);
        let leap = CivilTime::new(2024, 12, 31, 0, 0, 0).unwrap();
        assert_eq!(leap.day_of_year(), 366);
        assert_eq!(
            CivilTime::from_unix_seconds(-1, 0),
            CivilTime::new(1969, 12, 31, 23, 59, 59).unwrap()
        );
    }

    #[test]
    fn new_rejects_impossible_dates() {
        assert!(CivilTime::new(2025, 2, 29, 0, 0, 0).is_none());
        assert!(CivilTime::new(2024, 2, 29, 0, 0, 0).is_some());
        assert!(CivilTime::new(2025, 13, 1, 0, 0, 0).is_none());
        assert!(CivilTime::new(2025, 1, 1, 24, 0, 0).is_none());
    }

    #[test]
    fn system_clock_is_after_2024() {
        assert!(SystemClock.now().year >= 2024);
    }
}
